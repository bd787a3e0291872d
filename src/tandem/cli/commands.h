// Each subcommand registers its options and its action on the top-level CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace tandem::cli {

void add_generate_command(CLI::App& app);
void add_score_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_make_random_model_command(CLI::App& app);
void add_mtp_split_command(CLI::App& app);
void add_bench_spec_command(CLI::App& app);
void add_serve_command(CLI::App& app);

}  // namespace tandem::cli
