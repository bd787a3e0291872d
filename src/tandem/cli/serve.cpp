// tandem serve: the OpenAI-compatible server over the continuously batched speculative engine.
#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "tandem/backend/graph_cache.h"
#include "tandem/backend/memory_info.h"
#include "tandem/cli/commands.h"
#include "tandem/cli/common.h"
#include "tandem/core/error.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/warmup.h"
#include "tandem/io/artifact_identity.h"
#include "tandem/io/chat_template.h"
#include "tandem/server/http_server.h"

namespace tandem::cli {

namespace {

struct ServeArgs {
  std::string model;
  DraftArgs d;
  std::string host = "127.0.0.1";
  int port = 8000;
  int max_batch = 32;
  double kv_memory_gib = 0;      // 0: from free memory
  double prefix_cache_gib = -1;  // < 0: an eighth of the KV budget; 0: off
  std::string prefix_cache_dir;
  bool prefix_cache_persist = false;
  int max_queue = 256;
  int64_t prefill_budget = 256;
  int prefill_layers = 4;
  int prefill_slice_ratio = 3;
  int64_t default_max_tokens = 4096;
  std::string api_key;
  std::string served_model_name;
  int threads = 0;
  std::string backend = "auto";
  std::string kv_dtype = "bf16";
  int warmup_rows = -1;  // < 0: min(max_batch, kDefaultWarmupRows) on CUDA, none on the CPU
};

// Row counts a CUDA server warms up by default: past 32 rows a round is long enough that a cold
// graph's host time is a small share of it, and each row count adds a fraction of a second to
// the start-up.
constexpr int kDefaultWarmupRows = 32;

// The KV pool in blocks: the budget less every row slot's recurrent state, in whole blocks, and
// never more than max_batch rows at the full context could use.
int64_t pool_blocks(const ServeArgs& a, const Qwen35Config& cfg, int depth, DType kv_dtype,
                    uint64_t* budget) {
  const size_t block = Qwen35State::block_bytes(cfg, kv_dtype);
  const size_t rows = Qwen35State::row_bytes(cfg, depth + 1) * static_cast<size_t>(a.max_batch);
  const int64_t context = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768;
  const int64_t useful = a.max_batch * Qwen35State::blocks_for(context + depth + 1);
  if (a.kv_memory_gib > 0) {
    *budget = static_cast<uint64_t>(a.kv_memory_gib * double(1ull << 30));
  } else {
    const uint64_t avail = available_memory_bytes();
    if (avail == 0) fail("cannot read the free memory; give --kv-memory");
    // Half of what is free (CPU: the rest stays for the page cache and other processes; GPU:
    // workspaces and CUDA graphs grow with the batch), no more than useful.
    *budget = std::min<uint64_t>(avail / 2, rows + static_cast<uint64_t>(useful) * block);
  }
  if (*budget <= rows)
    fail("--kv-memory: ", *budget >> 20, " MiB do not cover the ", a.max_batch,
         " row slots' recurrent state (", rows >> 20, " MiB); lower --max-batch or raise it");
  if (block == 0) return 0;
  return std::min<int64_t>(useful, static_cast<int64_t>((*budget - rows) / block));
}

void run_serve(const ServeArgs& a) {
  if (a.port < 0 || a.port > 65535) fail("--port must be in 0..65535, got ", a.port);
  if (a.max_batch < 1 || a.max_batch > 4096) fail("--max-batch must be in 1..4096");
  if (a.max_queue < 0) fail("--max-queue must not be negative");
  if (a.kv_memory_gib < 0) fail("--kv-memory must not be negative");
  if (a.prefix_cache_gib < 0 && a.prefix_cache_gib != -1)
    fail("--prefix-cache-memory must not be negative");
  if (a.prefill_budget < 1) fail("--prefill-budget must be at least 1 token");
  if (a.prefill_layers < 0) fail("--prefill-layers must not be negative, got ", a.prefill_layers);
  if (a.prefill_slice_ratio < 0)
    fail("--prefill-slice-ratio must not be negative, got ", a.prefill_slice_ratio);
  if (a.default_max_tokens < 1) fail("--default-max-tokens must be at least 1");
  if (a.warmup_rows < -1) fail("--warmup-rows must not be negative, got ", a.warmup_rows);
  const SpecOptions spec = spec_options(a.d);
  const DType kv_dtype = parse_kv_dtype(a.kv_dtype);
  apply_threads(a.threads);
  const auto context = apply_backend(a.backend);
  const ops::ContextScope context_scope(*context);
  // The artifact identity keys drafter checkpoints and prefix-cache files (computed once per
  // weight file's metadata, memoized).
  const LoadedTarget target =
      load_target(a.model, a.d.draft != "none" || !a.prefix_cache_dir.empty());
  const auto tok = open_tokenizer(a.model);
  const auto tmpl = ChatTemplate::load(a.model);
  const auto drafter = open_drafter(a.d, *target.view);

  EngineOptions eo;
  eo.spec = spec;
  eo.max_rows = a.max_batch;
  eo.max_queue = static_cast<size_t>(a.max_queue);
  eo.prefill_budget = a.prefill_budget;
  eo.prefill_layers = a.prefill_layers;
  eo.prefill_slice_ratio = a.prefill_slice_ratio;
  const int depth = drafter ? spec.depth : 0;
  uint64_t budget = 0;
  eo.kv_dtype = kv_dtype;
  if (target.qwen) {
    eo.kv_blocks = pool_blocks(a, target.qwen->config(), depth, kv_dtype, &budget);
    if (eo.kv_blocks < 1) fail("the KV memory budget holds no block; raise --kv-memory");
    // The default: an eighth of the KV budget, at least 256 MiB (a small model's or a small
    // batch's KV budget would otherwise leave room for a handful of boundaries).
    eo.prefix_cache_bytes = a.prefix_cache_gib < 0
                                ? static_cast<size_t>(std::max<uint64_t>(budget / 8, 256ull << 20))
                                : static_cast<size_t>(a.prefix_cache_gib * double(1ull << 30));
  } else {
    // GLM-5's latent caches grow per row (no fixed pool); its prefix cache keeps copies of them
    // (256 MiB unless told), spilling to --prefix-cache-dir when there is one.
    if (a.kv_memory_gib > 0) fail("--kv-memory: GLM-5's caches grow on demand (no fixed pool)");
    eo.prefix_cache_bytes = a.prefix_cache_gib < 0
                                ? size_t{256} << 20
                                : static_cast<size_t>(a.prefix_cache_gib * double(1ull << 30));
  }
  if (!a.prefix_cache_dir.empty()) {
    if (eo.prefix_cache_bytes == 0) fail("--prefix-cache-dir needs --prefix-cache-memory above 0");
    eo.prefix_cache_dir = a.prefix_cache_dir;
    eo.prefix_cache_persist = a.prefix_cache_persist;
    const std::string tok_path = a.model + "/tokenizer.json";
    if (std::filesystem::exists(tok_path))
      eo.tokenizer_hash = artifact_identity("tokenizer", {tok_path});
  } else if (a.prefix_cache_persist) {
    fail("--prefix-cache-persist needs --prefix-cache-dir");
  }
  BatchEngine engine(target.engine_target(kv_dtype)(), drafter.get(), eo);
  const int warmup_rows = a.warmup_rows >= 0 ? std::min(a.warmup_rows, a.max_batch)
                          : ops::backend() == ops::Backend::Cuda
                              ? std::min(a.max_batch, kDefaultWarmupRows)
                              : 0;
  if (warmup_rows > 0) {
    std::fprintf(stderr, "tandem serve: warming up at 1..%d rows\n", warmup_rows);
    WarmupOptions wo;
    wo.max_rows = warmup_rows;
    wo.vocab_size = static_cast<int32_t>(target.view->vocab_size());
    double last = 0;
    wo.on_rows = [&](int rows, double seconds) {
      if (seconds - last < 5.0 || rows == warmup_rows) return;
      last = seconds;
      std::fprintf(stderr, "tandem serve: warm-up at %d of %d rows, %.1f s\n", rows, warmup_rows,
                   seconds);
    };
    // A failed warm-up costs the first clients some speed, not the server: it still serves.
    try {
      const WarmupReport w = warm_up(engine, wo);
      std::fprintf(stderr,
                   "tandem serve: warm-up done in %.2f s (%lld requests, %lld rounds, %lld CUDA "
                   "graphs run cold)\n",
                   w.seconds, static_cast<long long>(w.requests), static_cast<long long>(w.rounds),
                   static_cast<long long>(w.cold_graph_runs));
      if (w.graph_evictions > 0)
        std::fprintf(stderr,
                     "tandem serve: note: the warm-up's step shapes outnumber the CUDA graph "
                     "cache (%zu graphs a model): %lld were dropped and are captured again when "
                     "a client needs them; a smaller --warmup-rows keeps every one it captures\n",
                     GraphCache::kMaxGraphs, static_cast<long long>(w.graph_evictions));
    } catch (const Error& e) {
      std::fprintf(stderr, "tandem serve: warning: the warm-up failed (%s); serving without it\n",
                   e.what());
    }
  }

  server::ServerOptions so;
  so.host = a.host;
  so.port = a.port;
  so.api_key = a.api_key;
  so.served_model_name = a.served_model_name.empty()
                             ? std::filesystem::path(a.model).lexically_normal().filename().string()
                             : a.served_model_name;
  if (so.served_model_name.empty()) so.served_model_name = "tandem";
  so.default_max_tokens = a.default_max_tokens;
  so.http_threads = std::max(64, a.max_batch + a.max_queue / 4 + 16);
  so.draft_name = a.d.draft;

  // Signals are taken by this thread alone (sigwait below): every thread started from here on
  // inherits the mask. A client that hangs up must not kill the server with SIGPIPE.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  server::Server srv(engine, {target.view->vocab_size(), target.max_position_embeddings()},
                     tok ? &*tok : nullptr, tmpl ? &*tmpl : nullptr, so);
  const int port = srv.start();
  char kv[128] = "caches grow per row (no fixed pool)";
  if (eo.kv_blocks > 0)
    std::snprintf(kv, sizeof kv, "KV pool %lld blocks (%lld tokens, %.2f GiB budget)",
                  static_cast<long long>(eo.kv_blocks),
                  static_cast<long long>(engine.capacity_tokens()), double(budget) / (1ull << 30));
  std::fprintf(stderr,
               "tandem serve: model '%s' (%s), drafter %s depth %d, up to %d rows, %s, queue %d, "
               "prefix cache %.2f GiB\n",
               so.served_model_name.c_str(), ops::device_description().c_str(), a.d.draft.c_str(),
               depth, a.max_batch, kv, a.max_queue, double(eo.prefix_cache_bytes) / (1ull << 30));
  if (!tmpl) std::fprintf(stderr, "tandem serve: no chat template; /v1/chat/completions is off\n");
  std::fprintf(stderr, "tandem serve: listening on http://%s:%d\n", a.host.c_str(), port);
  std::fflush(stderr);
  int sig = 0;
  sigwait(&stop_signals, &sig);
  std::fprintf(stderr, "tandem serve: %s, shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  srv.stop();
  srv.wait();
  std::fprintf(stderr, "tandem serve: stopped\n");
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* sub = app.add_subcommand("serve", "OpenAI-compatible HTTP server");
  sub->add_option("--model", a->model, "Hugging Face model directory")->required();
  add_draft_options(sub, &a->d);
  add_kv_dtype_option(sub, &a->kv_dtype);
  sub->add_option("--host", a->host, "Address to listen on")->capture_default_str();
  sub->add_option("--port", a->port, "Port (0: any free port)")->capture_default_str();
  sub->add_option("--max-batch", a->max_batch, "Requests generating at once")
      ->capture_default_str();
  sub->add_option("--kv-memory", a->kv_memory_gib,
                  "GiB for the KV cache and row states (default: half the free memory, at most "
                  "what max-batch rows at full context use)");
  sub->add_option(
      "--prefix-cache-memory", a->prefix_cache_gib,
      "GiB for saved prompt prefixes (recurrent snapshots, drafter checkpoints and "
      "the KV blocks they keep from the pool; default: an eighth of --kv-memory, at least 0.25; "
      "0 = off). A request that starts with a saved prefix prefills only the rest");
  sub->add_option("--prefix-cache-dir", a->prefix_cache_dir,
                  "Folder for the prefix cache's disk tier: entries evicted from memory are "
                  "written there (one file each) and read back by this or a restarted server");
  sub->add_option("--warmup-rows", a->warmup_rows,
                  "Before listening, run synthetic requests at 1..N rows (greedy and sampled) so "
                  "that every round shape's CUDA graphs are captured and --depth auto starts from "
                  "measured round costs (default: min(--max-batch, 32) on CUDA, 0 on the CPU; 0 = "
                  "none)");
  sub->add_flag("--prefix-cache-persist", a->prefix_cache_persist,
                "On shutdown, write every cached prefix to --prefix-cache-dir");
  sub->add_option("--max-queue", a->max_queue,
                  "Requests waiting for room; beyond it requests get 503")
      ->capture_default_str();
  sub->add_option("--prefill-budget", a->prefill_budget,
                  "Prompt tokens prefilled per engine step, between decode rounds")
      ->capture_default_str();
  sub->add_option("--prefill-layers", a->prefill_layers,
                  "Layers of a prefill forward run per step while other requests decode (0 = "
                  "the whole forward): lower keeps their inter-token latency flat while a long "
                  "prompt is admitted, higher gives that prompt its first token sooner; the "
                  "tokens are the same either way")
      ->capture_default_str();
  sub->add_option("--prefill-slice-ratio", a->prefill_slice_ratio,
                  "Prompts that fit one chunk are sliced only while this many requests decode "
                  "per request prefilling (0 = always; longer prompts are always sliced)")
      ->capture_default_str();
  sub->add_option("--default-max-tokens", a->default_max_tokens,
                  "max_tokens of chat requests that give none (capped by the context)")
      ->capture_default_str();
  sub->add_option("--api-key", a->api_key, "Require Authorization: Bearer KEY (not on /health)");
  sub->add_option("--served-model-name", a->served_model_name,
                  "Model name clients ask for (default: the model directory's name)");
  sub->add_option("--threads", a->threads, "CPU threads (0 = all cores)");
  sub->add_option("--backend", a->backend, "cpu, cuda or auto")->capture_default_str();
  sub->callback([a] { run_serve(*a); });
}

}  // namespace tandem::cli
