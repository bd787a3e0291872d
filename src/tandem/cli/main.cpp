// tandem: the command line. User errors print "error: ..." and exit 1; nothing aborts.
#include <cstdio>
#include <exception>

#include "tandem/cli/commands.h"
#include "tandem/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"tandem: LLM inference with lossless speculative decoding"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "tandem 0.1.0");
  tandem::cli::add_generate_command(app);
  tandem::cli::add_score_command(app);
  tandem::cli::add_bench_command(app);
  tandem::cli::add_make_random_model_command(app);
  tandem::cli::add_mtp_split_command(app);
  tandem::cli::add_bench_spec_command(app);
  tandem::cli::add_serve_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
