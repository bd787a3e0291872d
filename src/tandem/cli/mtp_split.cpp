// tandem mtp-split: a companion MTP drafter directory from a checkpoint that carries `mtp.*`.
#include <cstdio>

#include "tandem/cli/commands.h"
#include "tandem/spec/qwen_mtp_split.h"

namespace tandem::cli {

void add_mtp_split_command(CLI::App& app) {
  struct Args {
    std::string model, out;
    int64_t block_size = 4;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand(
      "mtp-split",
      "Write a companion MTP drafter directory (qwen3_5_mtp) from a checkpoint's mtp.*");
  sub->add_option("--model", a->model, "Qwen3.5 model directory with mtp.* tensors")->required();
  sub->add_option("--out", a->out, "Output directory (must not exist or be empty)")->required();
  sub->add_option("--block-size", a->block_size, "block_size in config.json (drafting depth + 1)")
      ->capture_default_str();
  sub->callback([a] {
    const spec::MtpSplitResult r = spec::write_mtp_companion(a->model, a->out, a->block_size);
    std::fprintf(stderr, "wrote %s (%lld tensors, %.1f MB)\n", a->out.c_str(),
                 static_cast<long long>(r.tensors), static_cast<double>(r.bytes) / 1e6);
  });
}

}  // namespace tandem::cli
