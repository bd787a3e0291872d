// tandem make-random-model: a random-weight checkpoint of a given config, for benchmarks.
#include <cstdio>

#include "tandem/cli/commands.h"
#include "tandem/core/error.h"
#include "tandem/io/json_file.h"
#include "tandem/model/glm5_random.h"
#include "tandem/model/qwen3_5_random.h"

namespace tandem::cli {

void add_make_random_model_command(CLI::App& app) {
  struct Args {
    std::string config, out, dtype = "bf16";
    uint64_t seed = 0;
    bool per_expert = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand("make-random-model",
                                     "Write a random-weight checkpoint for a config.json "
                                     "(Qwen3.5 dense or MoE, or GLM-5)");
  sub->add_option("--config", a->config, "config.json giving the shape")->required();
  sub->add_option("--out", a->out, "Output directory")->required();
  sub->add_option("--dtype", a->dtype,
                  "f32, bf16 or f16; GLM-5 also fp8 (e4m3 matrices with the block scales of the "
                  "config's quantization_config, which also a 16-bit dtype follows, the other "
                  "tensors bf16)")
      ->capture_default_str();
  sub->add_option("--seed", a->seed, "Random seed")->capture_default_str();
  sub->add_flag("--per-expert-tensors", a->per_expert,
                "Mixtures of experts: one tensor per expert projection instead of transformers' "
                "fused experts.gate_up_proj / down_proj");
  sub->callback([a] {
    const nlohmann::json cfg = read_json_file(a->config);
    const bool glm = cfg.is_object() && cfg.value("model_type", std::string()) == "glm_moe_dsa";
    DType t;
    if (a->dtype == "fp8" && glm) {
      // The layout the published fp8 release has: its block size comes from the config, the
      // tensors that stay in 16 bits (embedding, head, router, norms) are bf16.
      if (!cfg.contains("quantization_config"))
        fail("--dtype fp8: ", a->config,
             " has no quantization_config (the fp8 block size, e.g. \"weight_block_size\": "
             "[128, 128]); add it, or choose f32, bf16 or f16");
      t = DType::BF16;
    } else if (a->dtype == "f32")
      t = DType::F32;
    else if (a->dtype == "bf16")
      t = DType::BF16;
    else if (a->dtype == "f16")
      t = DType::F16;
    else
      fail("--dtype must be f32, bf16 or f16", glm ? " or fp8" : "", ", got '", a->dtype, "'");
    if (glm)
      write_random_glm5(a->config, a->out, t, a->seed, a->per_expert);
    else
      write_random_qwen35(a->config, a->out, t, a->seed, a->per_expert);
    std::fprintf(stderr, "wrote %s\n", a->out.c_str());
  });
}

}  // namespace tandem::cli
