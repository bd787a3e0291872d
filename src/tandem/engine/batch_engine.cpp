#include "tandem/engine/batch_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "tandem/backend/context.h"
#include "tandem/backend/graph_cache.h"
#include "tandem/backend/ops.h"
#include "tandem/core/error.h"
#include "tandem/engine/qwen_engine_target.h"

namespace tandem {

namespace {

std::vector<int> all_but_last(int n) {
  std::vector<int> keep(static_cast<size_t>(std::max(n - 1, 0)));
  for (int i = 0; i + 1 < n; ++i) keep[static_cast<size_t>(i)] = i;
  return keep;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// A round's log line as far as every kind of round has it: its rows and depth, its host time, and
// the device wait and cold graph runs since `wait0` and `cold0` were read at its start.
RoundRecord round_record(size_t rows, int depth, double seconds, double wait0, int64_t cold0) {
  RoundRecord r;
  r.rows = static_cast<int64_t>(rows);
  r.depth = depth;
  r.seconds = seconds;
  r.wait = ops::device_wait_seconds() - wait0;
  r.cold_graph_runs = GraphCache::cold_runs() - cold0;
  return r;
}

// A round's time for the depth policy, or 0 (not timed: only its acceptance counts) where the
// round ran a CUDA graph cold since `cold_runs` (GraphCache::cold_runs), or waited for device work
// queued before it (`other_work`: a prompt's prefill): the first rounds of each shape cost several
// times a warm one, the first round after a prefill as much as the prefill's tail, and a depth
// whose one measurement is such a round looks too dear to be tried again.
double timed(double seconds, int64_t cold_runs, bool other_work) {
  return GraphCache::cold_runs() == cold_runs && !other_work ? seconds : 0.0;
}

// A joining row's target state: its slot and, under a fixed pool, every KV block the request can
// ever need, so no round can run out of memory half-way. Dispose closes the slot again.
class TargetJoin : public spec::PreparedChange {
 public:
  // hit: a prefix-cache hit the row starts from (tokens 0: a cold row).
  TargetJoin(EngineTarget& target, int64_t reserve_tokens, PrefixStore* cache, const PrefixHit& hit)
      : target_(target) {
    slot_ = target_.open_row();
    try {
      if (hit.tokens > 0) cache->restore(hit, slot_);
      if (reserve_tokens > 0) target_.reserve(slot_, reserve_tokens);
    } catch (...) {
      target_.close_row(slot_);
      throw;
    }
  }
  int slot() const { return slot_; }
  void commit() noexcept override { committed_ = true; }
  void dispose() noexcept override {
    if (!committed_) target_.close_row(slot_);
  }

 private:
  EngineTarget& target_;
  int slot_ = -1;
  bool committed_ = false;
};

// log softmax of the chosen token and the top-n alternatives, from raw logits.
void fill_logprobs(std::span<const float> logits, int top_n, TokenOutput* t) {
  float mx = -INFINITY;
  for (float l : logits) mx = std::max(mx, l);
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - mx);
  const double lse = mx + std::log(sum);
  t->has_logprob = true;
  t->logprob = static_cast<float>(logits[static_cast<size_t>(t->id)] - lse);
  t->top_logprobs.clear();
  if (top_n > 0)
    for (const auto& [id, l] : top_logits(logits, top_n))
      t->top_logprobs.emplace_back(id, static_cast<float>(l - lse));
}

}  // namespace

struct BatchEngine::Row {
  uint64_t id = 0;  // unique for the engine's lifetime
  EngineRequest req;
  std::shared_ptr<RequestSink> sink;
  int slot = -1;
  int64_t prefilled = 0;  // prompt tokens the target has processed
  int64_t cached = 0;     // of which restored from the prefix cache
  GenerateResult result;  // generated tokens so far
  SpecStats stats;
  bool done = false;                      // the outcome was sent; retire() drops the row
  RequestEnd end = RequestEnd::Finished;  // once done
  // Tokens (prompt, then output) the row's decode drafter has taken in; behind the target's
  // after plain rounds that ran without it (token drafters, depth_zero_pipelines).
  int64_t drafter_synced = 0;
  // Tokens the target has processed once no step is in flight: all but the pending one.
  int64_t processed() const {
    return static_cast<int64_t>(req.gen.prompt.size() + result.tokens.size()) - 1;
  }
  // Decode rounds draw every token where the logits are (ops::sample_rows) and copy logits to
  // the host only for log-probabilities; a prompt's first token is drawn on the host.
  bool needs_logits() const { return req.top_logprobs >= 0; }
  bool first_token_needs_logits() const {
    return !req.gen.sampling.greedy() || req.top_logprobs >= 0;
  }
};

BatchEngine::BatchEngine(const Qwen35Model& model, const spec::DraftProvider* drafter,
                         std::string target_identity, EngineOptions options)
    : BatchEngine(
          std::make_unique<QwenEngineTarget>(model, std::move(target_identity), options.kv_dtype),
          drafter, options) {}

BatchEngine::BatchEngine(std::unique_ptr<EngineTarget> target, const spec::DraftProvider* drafter,
                         EngineOptions options)
    : target_(std::move(target)), drafter_(drafter), options_(options) {
  const ops::ContextScope scope(target_->context());
  if (options_.spec.depth < 0 || options_.spec.depth > 16)
    fail("--depth must be in 0..16, got ", options_.spec.depth);
  if (options_.max_rows < 0) fail("the engine's row limit must be at least 1");
  if (options_.prefill_budget < 0) fail("the prefill budget must not be negative");
  if (options_.prefill_layers < 0)
    fail("the prefill layers per step must not be negative, got ", options_.prefill_layers);
  if (options_.prefill_slice_ratio < 0)
    fail("the prefill slice ratio must not be negative, got ", options_.prefill_slice_ratio);
  if (options_.spec.prefill_chunk < 1)
    fail("the prefill chunk must be at least 1 token, got ", options_.spec.prefill_chunk);
  depth_ = drafter_ ? options_.spec.depth : 0;
  draft_depth_ = depth_;
  round_log_ = options_.round_log ? options_.round_log : RoundLog::from_env();
  health_ = spec::DrafterHealth(options_.spec.health);
  if (options_.spec.auto_depth && depth_ > 0) {
    policy_ = options_.depth_policy;
    if (!policy_)
      policy_ = std::make_shared<spec::DepthPolicy>(spec::DepthPolicyOptions{.max_depth = depth_});
    else if (policy_->max_depth() != depth_)
      fail("the shared depth policy proposes up to ", policy_->max_depth(),
           " tokens, but the engine's depth is ", depth_);
  }
  if (drafter_) {
    prefill_drafts_ = drafter_->open_rows(target_->view());
    decode_drafts_ = drafter_->open_rows(target_->view());
    if (prefill_drafts_->prefill_mode() != spec::PrefillMode::Full)
      fail("drafter '", drafter_->id(), "': only full-prompt prefill is supported");
    taps_ = prefill_drafts_->taps();
    want_final_ = taps_.hidden == spec::HiddenTap::FinalNormed;
    want_prenorm_ = taps_.hidden == spec::HiddenTap::PreNorm;
    // The prompt's hiddens stay where the target computed them when the drafter reads them
    // there: no copy of every prompt token's hidden to the host and back.
    prompt_hidden_on_device_ =
        taps_.hidden && prefill_drafts_->prefills_from_device() && target_->keeps_prompt_hidden();
  }
  if (options_.kv_blocks > 0) {
    if (options_.max_rows == 0) fail("a fixed KV pool needs a row limit");
    target_->set_fixed_pool(options_.max_rows, options_.kv_blocks, depth_ + 1);
  }
  if (options_.prefix_cache_bytes > 0) {
    cache_ = target_->open_prefix_cache(options_.prefix_cache_bytes);
    if (!cache_) fail("the prefix cache is not supported for this target");
  }
  if (!options_.prefix_cache_dir.empty()) {
    if (!cache_) fail("a prefix-cache folder needs a prefix cache (its memory budget is 0)");
    const std::optional<PrefixDiskLayout> layout = cache_->disk_layout();
    if (!layout)
      fail("a prefix-cache folder is not supported for this target (its cache has no disk tier)");
    const std::string& identity = target_->view().identity();
    if (identity.empty())
      fail("a prefix-cache folder needs the target's artifact identity to key its files");
    disk_ = std::make_unique<PrefixDisk>(
        options_.prefix_cache_dir,
        PrefixDiskKey{identity, options_.tokenizer_hash, layout->kv_scheme, layout->kv_dtype});
    cache_->attach_disk(disk_.get());
  }
  counters_.kv_blocks_total = options_.kv_blocks;
  counters_.prefix_max_bytes = static_cast<int64_t>(options_.prefix_cache_bytes);
  counters_.drafted_by_position.assign(static_cast<size_t>(depth_), 0);
  counters_.rounds_by_depth.assign(static_cast<size_t>(depth_) + 1, 0);
  counters_.accepted_by_position.assign(static_cast<size_t>(depth_), 0);
}

BatchEngine::~BatchEngine() {
  const ops::ContextScope scope(target_->context());
  if (work_queued()) abandon_chain();
  if (cache_ && options_.prefix_cache_persist) {
    try {
      cache_->persist_all();
    } catch (const std::exception&) {
      // Shutting down: what could not be written is only not kept.
    }
  }
}

int64_t BatchEngine::tokens_needed(int64_t prompt_tokens, int64_t max_tokens) const {
  return prompt_tokens + max_tokens + depth_ + 1;
}

int64_t BatchEngine::capacity_tokens() const {
  return target_->fixed() ? target_->total_blocks() * target_->block_tokens() : 0;
}

void BatchEngine::validate(const EngineRequest& r) const {
  const int64_t V = target_->vocab_size();
  const GenerateRequest& g = r.gen;
  if (g.prompt.empty()) fail("the prompt is empty");
  for (int32_t id : g.prompt)
    if (id < 0 || id >= V) fail("prompt token id ", id, " is out of range [0, ", V, ")");
  if (g.max_tokens < 1) fail("max_tokens must be at least 1, got ", g.max_tokens);
  g.sampling.validate();
  if (r.top_logprobs < -1 || r.top_logprobs > 20)
    fail("top_logprobs must be in 0..20, got ", r.top_logprobs);
  const int64_t cap = capacity_tokens();
  const int64_t need = tokens_needed(static_cast<int64_t>(g.prompt.size()), g.max_tokens);
  if (cap > 0 && need > cap)
    fail("the prompt (", g.prompt.size(), " tokens) with max_tokens ", g.max_tokens, " needs ",
         need, " KV positions, more than the whole pool holds (", cap, ")");
}

BatchEngine::Submit BatchEngine::submit(EngineRequest request, std::shared_ptr<RequestSink> sink) {
  validate(request);
  {
    std::lock_guard lock(mu_);
    if (options_.max_queue > 0 && queue_.size() >= options_.max_queue) return Submit::QueueFull;
    queue_.push_back({std::move(request), std::move(sink)});
    counters_.queued = static_cast<int64_t>(queue_.size());
  }
  wake_.notify_one();
  return Submit::Queued;
}

void BatchEngine::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
}

EngineCounters BatchEngine::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

void BatchEngine::publish_counters() {
  std::lock_guard lock(mu_);
  counters_.queued = static_cast<int64_t>(queue_.size());
  counters_.prefilling = static_cast<int64_t>(prefilling_.size());
  counters_.decoding = static_cast<int64_t>(decoding_.size());
  if (target_->fixed()) counters_.kv_blocks_used = target_->total_blocks() - target_->free_blocks();
  if (cache_) {
    const PrefixCacheStats c = cache_->stats();
    counters_.prefix_entries = c.entries;
    counters_.prefix_evictions = c.evictions;
    counters_.prefix_kv_blocks = c.kv_blocks;
    counters_.prefix_bytes = static_cast<int64_t>(c.bytes);
    counters_.prefix_disk_files = c.disk_files;
    counters_.prefix_disk_writes = c.disk_writes;
    counters_.prefix_disk_removed = c.disk_removed;
    counters_.prefix_disk_bytes = c.disk_bytes;
  }
}

void BatchEngine::finish(Row& row, RequestEnd end, const std::string& error) {
  if (row.done) return;
  row.done = true;
  row.end = end;
  RequestOutcome o;
  o.end = end;
  o.finish = row.result.finish;
  o.error = error;
  o.prompt_tokens = static_cast<int64_t>(row.req.gen.prompt.size());
  o.cached_tokens = row.cached;
  o.generated_tokens = static_cast<int64_t>(row.result.tokens.size());
  o.speculation = row.stats;
  {
    std::lock_guard lock(mu_);
    (end == RequestEnd::Finished    ? counters_.finished
     : end == RequestEnd::Cancelled ? counters_.cancelled
                                    : counters_.failed)++;
  }
  try {
    row.sink->on_finish(o);
  } catch (...) {  // the consumer is gone; nothing is left to tell it
  }
}

bool BatchEngine::emit(Row& row, int32_t id, const float* logits) {
  TokenOutput t;
  t.id = id;
  t.index = row.result.tokens.size();
  if (row.req.top_logprobs >= 0) {
    TANDEM_CHECK(logits != nullptr, "log-probabilities without logits");
    fill_logprobs({logits, static_cast<size_t>(target_->vocab_size())}, row.req.top_logprobs, &t);
  }
  const bool ended = append_token(row.req.gen, target_->eos_token_ids(), id, &row.result);
  ++row.stats.emitted;
  {
    std::lock_guard lock(mu_);
    ++counters_.generated_tokens;
  }
  bool go_on = true;
  try {
    go_on = row.sink->on_token(t);
  } catch (const std::exception& e) {
    finish(row, RequestEnd::Failed, e.what());
    return false;
  }
  if (!go_on) {
    row.result.finish = FinishReason::Stop;
    finish(row, RequestEnd::Finished);
    return false;
  }
  if (ended) {
    finish(row, RequestEnd::Finished);
    return false;
  }
  return true;
}

void BatchEngine::retire() {
  // Settled rounds still queued hold the rows: they are read before any row leaves.
  if (!settled_.empty()) {
    bool any = false;
    for (const auto& r : decoding_) any = any || r->done;
    if (any) {
      try {
        drain_timed();
      } catch (const std::exception& e) {
        abandon_chain();
        fail_rows(decoding_, std::string("decode round failed: ") + e.what());
      }
    }
  }
  // A finished row of the forward in flight (only an error path gets here: cancellations
  // complete the forward first) would hand its slot back while the forward still writes it:
  // the forward stops, and its other rows, whose state it left part-advanced, fail.
  if (target_->prompt_active()) {
    bool hit = false;
    for (const auto& r : prefilling_) hit = hit || (r->done && in_flight(*r));
    if (hit) {
      for (auto& r : prefilling_)
        if (in_flight(*r))
          finish(*r, RequestEnd::Failed, "its prefill forward was interrupted by a neighbour");
      target_->abandon_prompt();
    }
  }
  auto drop = [&](std::vector<std::unique_ptr<Row>>& rows, spec::DraftRows* drafts) {
    std::vector<int> keep;
    std::vector<std::unique_ptr<Row>> still;
    for (size_t r = 0; r < rows.size(); ++r) {
      if (rows[r]->done) {
        if (&rows == &decoding_) save_turn(*rows[r], r);
        if (rows[r]->slot >= 0) target_->close_row(rows[r]->slot);
      } else {
        keep.push_back(static_cast<int>(r));
        still.push_back(std::move(rows[r]));
      }
    }
    if (still.size() != rows.size() && drafts) drafts->filter_rows(keep);
    rows.swap(still);
  };
  drop(prefilling_, prefill_drafts_.get());
  drop(decoding_, decode_drafts_.get());
}

void BatchEngine::fail_rows(std::vector<std::unique_ptr<Row>>& rows, const std::string& what) {
  for (auto& r : rows) finish(*r, RequestEnd::Failed, what);
}

void BatchEngine::admit() {
  const std::string draft_ns = prefill_drafts_ ? prefill_drafts_->ns() : std::string();
  // Another namespace's boundary serves when the drafter adopts it without changing the output.
  const bool adopt_other = prefill_drafts_ && (prefill_drafts_->adopts_exactly() ||
                                               options_.spec.verify == spec::VerifyMode::Match);
  for (;;) {
    Pending p;
    PrefixHit hit;
    {
      std::lock_guard lock(mu_);
      if (queue_.empty()) return;
      const size_t rows = prefilling_.size() + decoding_.size();
      if (options_.max_rows > 0 && rows >= static_cast<size_t>(options_.max_rows)) return;
      const Pending& head = queue_.front();
      if (!head.sink->cancelled() && cache_)
        hit = cache_->lookup(head.request.gen.prompt, draft_ns, adopt_other);
      if (target_->fixed() && !head.sink->cancelled()) {
        // The blocks below a hit are shared, not taken; the pool's blocks that only the cache
        // holds are given back to admit the head if need be.
        const int64_t need =
            target_->blocks_for(tokens_needed(static_cast<int64_t>(head.request.gen.prompt.size()),
                                              head.request.gen.max_tokens)) -
            hit.tokens / target_->block_tokens();
        // The head waits for room (first come, first served); it fits an empty pool (submit).
        if (target_->has_kv() && need > target_->free_blocks() &&
            !(cache_ && cache_->make_room(need, hit.entry)))
          return;
      }
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    auto row = std::make_unique<Row>();
    row->id = next_row_id_++;
    row->req = std::move(p.request);
    row->sink = std::move(p.sink);
    row->stats.accepted_by_position.assign(static_cast<size_t>(depth_), 0);
    row->stats.drafted_by_position.assign(static_cast<size_t>(depth_), 0);
    if (row->sink->cancelled()) {
      finish(*row, RequestEnd::Cancelled);
      continue;
    }
    const int64_t reserve = target_->fixed()
                                ? tokens_needed(static_cast<int64_t>(row->req.gen.prompt.size()),
                                                row->req.gen.max_tokens)
                                : 0;
    try {
      // The join: target slot + blocks and the drafter's cold prefill row, all or nothing.
      // apply_changes destroys the prepared changes when it returns: keep the slot, not them.
      int slot = -1;
      std::vector<spec::PrepareFn> changes;
      changes.push_back([&]() -> std::unique_ptr<spec::PreparedChange> {
        auto t = std::make_unique<TargetJoin>(*target_, reserve, cache_.get(), hit);
        slot = t->slot();
        return t;
      });
      // A hit restores the drafter's checkpoint of the same boundary with the target's state.
      const spec::CheckpointPtr from[1] = {hit.draft};
      if (prefill_drafts_) changes.push_back([&] { return prefill_drafts_->prepare_append(from); });
      spec::apply_changes(changes);
      row->slot = slot;
      // A boundary without this drafter's state: the drafter adopts it from the tokens.
      if (prefill_drafts_ && hit.tokens > 0 && !hit.draft) {
        try {
          prefill_drafts_->adopt_prefix(
              prefill_drafts_->row_count() - 1,
              std::span(row->req.gen.prompt).first(static_cast<size_t>(hit.tokens)));
        } catch (...) {
          target_->close_row(slot);
          prefill_drafts_->filter_rows(all_but_last(prefill_drafts_->row_count()));
          throw;
        }
      }
    } catch (const std::exception& e) {
      finish(*row, RequestEnd::Failed, std::string("admission failed: ") + e.what());
      continue;
    }
    row->prefilled = row->cached = hit.tokens;
    {
      std::lock_guard lock(mu_);
      counters_.prompt_tokens += static_cast<int64_t>(row->req.gen.prompt.size());
      if (cache_) {
        ++(hit.tokens > 0 ? counters_.prefix_hits : counters_.prefix_misses);
        counters_.prefix_disk_hits += hit.from_disk;
        counters_.prefix_tokens_reused += hit.tokens;
      }
    }
    prefilling_.push_back(std::move(row));
  }
}

bool BatchEngine::in_flight(const Row& row) const {
  if (!target_->prompt_active()) return false;
  return std::find(inflight_ids_.begin(), inflight_ids_.end(), row.id) != inflight_ids_.end();
}

void BatchEngine::begin_prefill() {
  const int64_t budget = options_.prefill_budget;
  // Rows in join order, one chunk each, while the budget lasts (at least one chunk runs).
  inflight_ids_.clear();
  int64_t used = 0;
  tokens_.clear();
  inputs_.clear();
  for (const auto& rp : prefilling_) {
    const Row& row = *rp;
    const int64_t L = static_cast<int64_t>(row.req.gen.prompt.size());
    // Chunks end on the fixed grid counted from the prompt's start, also after a cache hit.
    const int64_t C = options_.spec.prefill_chunk;
    const int64_t n = std::min(C - row.prefilled % C, L - row.prefilled);
    if (budget > 0 && used > 0 && used + n > budget) break;
    inflight_ids_.push_back(row.id);
    used += n;
    tokens_.insert(tokens_.end(), row.req.gen.prompt.begin() + row.prefilled,
                   row.req.gen.prompt.begin() + row.prefilled + n);
    inputs_.push_back({row.slot, n, false});
  }
  // Logits rows are the rows' last tokens; only rows finishing their prompt use theirs. Rows
  // that need no logits on the host take the device's greedy token.
  inflight_logits_ = false;
  inflight_long_ = false;
  for (size_t k = 0; k < inflight_ids_.size(); ++k) {
    const Row& row = *prefilling_[k];
    if (static_cast<int64_t>(row.req.gen.prompt.size()) > options_.spec.prefill_chunk)
      inflight_long_ = true;
    if (row.prefilled + inputs_[k].n_tokens == static_cast<int64_t>(row.req.gen.prompt.size()) &&
        row.first_token_needs_logits())
      inflight_logits_ = true;
  }
  ForwardRequest fwd{tokens_, inputs_, false, want_final_, want_prenorm_};
  fwd.tap_layers = taps_.layers;
  fwd.prompt = true;
  fwd.prompt_gemm_rows = ops::prefill_gemm_rows(options_.spec.prefill_chunk);
  fwd.hidden_on_device = prompt_hidden_on_device_;
  fwd.want_logits = inflight_logits_;
  fwd.want_argmax = !inflight_logits_;
  target_->begin_prompt(fwd);
}

bool BatchEngine::advance_prefill(bool whole) {
  const auto t0 = std::chrono::steady_clock::now();
  work_between_rounds_ = true;
  if (!target_->prompt_active()) begin_prefill();
  // While rows decode, a forward of a long prompt's chunk, or of short prompts while enough
  // rows decode, runs a slice of its layers per step (EngineOptions::prefill_slice_ratio).
  const bool slice =
      !whole && !decoding_.empty() &&
      (inflight_long_ ||
       decoding_.size() >= static_cast<size_t>(options_.prefill_slice_ratio) * prefilling_.size());
  const bool done = target_->continue_prompt(slice ? options_.prefill_layers : 0, &out_);
  {
    std::lock_guard lock(mu_);
    counters_.prefill_seconds += seconds_since(t0);
  }
  if (done) finish_prefill();
  return done;
}

void BatchEngine::prefill_step() {
  const int64_t budget = options_.prefill_budget;
  while (target_->prompt_active() || !prefilling_.empty()) {
    if (!advance_prefill(false)) return;
    retire();
    if (budget > 0) return;
  }
}

void BatchEngine::finish_prefill() {
  const int64_t H = target_->hidden_size();
  const int64_t V = target_->vocab_size();
  // The forward's rows in prefilling_ (rows that joined or left meanwhile shifted the indices;
  // none of the forward's own rows can have left).
  std::vector<size_t> picked;
  for (uint64_t id : inflight_ids_) {
    size_t r = 0;
    while (r < prefilling_.size() && prefilling_[r]->id != id) ++r;
    TANDEM_CHECK(r < prefilling_.size(), "a row of the prefill forward left while it ran");
    picked.push_back(r);
  }
  const std::span<const RowInput> rows = target_->prompt_rows();  // [k].n_tokens: row k's chunk
  const bool need_logits = inflight_logits_;
  // Counted on every way out (rows that failed or finished return early).
  struct CountDrafter {
    BatchEngine& e;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~CountDrafter() {
      if (!e.drafter_) return;
      std::lock_guard lock(e.mu_);
      e.counters_.drafter_prefill_seconds += seconds_since(t0);
    }
  } count_drafter{*this};
  if (prefill_drafts_) {
    const float* hidden = prompt_hidden_on_device_ ? nullptr : tapped_rows();
    const float* hidden_device =
        prompt_hidden_on_device_ ? target_->prompt_hidden(want_prenorm_) : nullptr;
    const int64_t width = taps_.width(H);
    std::vector<spec::RowPrefill> pre(picked.size());
    int64_t off = 0;
    for (size_t k = 0; k < picked.size(); ++k) {
      const Row& row = *prefilling_[picked[k]];
      pre[k].row = static_cast<int>(picked[k]);
      pre[k].tokens =
          std::span(row.req.gen.prompt)
              .subspan(static_cast<size_t>(row.prefilled), static_cast<size_t>(rows[k].n_tokens));
      pre[k].hidden = hidden ? hidden + off * width : nullptr;
      pre[k].hidden_device = hidden_device ? hidden_device + off * width : nullptr;
      pre[k].processed_before = row.prefilled;
      off += rows[k].n_tokens;
    }
    prefill_drafts_->prefill(pre);
  }
  {
    std::lock_guard lock(mu_);
    ++counters_.prefill_forwards;
  }
  // Rows whose prompt is complete sample their first token, then move to the decoding group.
  std::vector<size_t> ready;
  for (size_t k = 0; k < picked.size(); ++k) {
    Row& row = *prefilling_[picked[k]];
    row.prefilled += rows[k].n_tokens;
    ++row.stats.target_forwards;
    save_boundary(row, picked[k]);
    if (row.prefilled < static_cast<int64_t>(row.req.gen.prompt.size())) continue;
    if (row.sink->cancelled()) {  // cancelled while its forward ran: no first token
      finish(row, RequestEnd::Cancelled);
      continue;
    }
    const float* logits = need_logits ? out_.logits.data() + k * V : nullptr;
    int32_t tok = 0;
    try {
      tok = need_logits ? sample_token({logits, static_cast<size_t>(V)}, row.req.gen.sampling, 0,
                                       &dist_scratch_)
                        : out_.argmax[k];
    } catch (const std::exception& e) {
      finish(row, RequestEnd::Failed, e.what());
      continue;
    }
    if (emit(row, tok, logits)) ready.push_back(picked[k]);
  }
  if (ready.empty()) return;
  // The move: each row's drafter state is copied into the decoding group (where the drafter
  // can, in backend memory; else through a checkpoint); only when that append commits does the
  // row leave the prefill group.
  try {
    if (decode_drafts_) {
      const auto t_move = std::chrono::steady_clock::now();
      const std::vector<int> rows(ready.begin(), ready.end());
      decode_drafts_->copy_rows(*prefill_drafts_, rows);
      std::lock_guard lock(mu_);
      counters_.drafter_move_seconds += seconds_since(t_move);
    }
  } catch (const std::exception& e) {
    for (size_t r : ready)
      finish(*prefilling_[r], RequestEnd::Failed,
             std::string("drafter refused the row: ") + e.what());
    return;
  }
  // Rows move in join order, so their rows in the decoding group match decoding_.
  std::vector<bool> moving(prefilling_.size(), false);
  for (size_t r : ready) moving[r] = true;
  std::vector<int> keep;
  std::vector<std::unique_ptr<Row>> still;
  for (size_t r = 0; r < prefilling_.size(); ++r) {
    if (moving[r]) {
      prefilling_[r]->drafter_synced = prefilling_[r]->prefilled;
      decoding_.push_back(std::move(prefilling_[r]));
    } else {
      keep.push_back(static_cast<int>(r));
      still.push_back(std::move(prefilling_[r]));
    }
  }
  if (prefill_drafts_) prefill_drafts_->filter_rows(keep);
  prefilling_.swap(still);
}

void BatchEngine::save_boundary(const Row& row, size_t prefill_index) {
  if (!cache_) return;
  const int64_t p = row.prefilled;
  const int64_t L = static_cast<int64_t>(row.req.gen.prompt.size());
  const bool on_grid = p % options_.spec.prefill_chunk == 0;
  if (!on_grid && !(p == L && target_->prompt_matches_decode())) return;
  save_state(std::span(row.req.gen.prompt).first(static_cast<size_t>(p)), row.slot,
             prefill_drafts_.get(), prefill_index);
}

void BatchEngine::save_state(std::span<const int32_t> tokens, int slot, spec::DraftRows* drafts,
                             size_t draft_row) {
  try {
    spec::CheckpointPtr draft;
    if (drafts) draft = drafts->capture(static_cast<int>(draft_row));
    // A drafter state that starts after token 0 is not what a cold prefill gives: the boundary is
    // kept for the target alone.
    if (draft && draft->history_from > 0) draft = nullptr;
    cache_->insert(tokens, slot, std::move(draft));
  } catch (const std::exception&) {
    // A boundary that cannot be saved (a drafter that refuses to capture, no memory) is a
    // missed optimisation, never a failed request.
  }
}

void BatchEngine::save_turn(const Row& row, size_t decode_index) {
  // Where decoding a token gives it the bits a prompt prefill would (the CPU), the state a
  // finished request leaves is the one a cold prefill of its prompt + answer reaches: the next
  // turn of a chat starts there. Elsewhere only the prefill grid's boundaries are exact.
  if (!cache_ || !target_->prompt_matches_decode() || row.end != RequestEnd::Finished) return;
  const int64_t P = static_cast<int64_t>(row.req.gen.prompt.size());
  const int64_t length = target_->length(row.slot);
  const int64_t answered = length - P;
  // Tokens a stop string dropped were processed but never emitted: no token list to key them.
  if (answered < 1 || answered > static_cast<int64_t>(row.result.tokens.size())) return;
  std::vector<int32_t> tokens = row.req.gen.prompt;
  tokens.insert(tokens.end(), row.result.tokens.begin(), row.result.tokens.begin() + answered);
  save_state(tokens, row.slot, decode_drafts_.get(), decode_index);
}

const float* BatchEngine::tapped_rows() const {
  if (!taps_.layers.empty()) return out_.layer_taps.data();
  if (want_prenorm_) return out_.prenorm_hidden.data();
  if (want_final_) return out_.hidden.data();
  return nullptr;
}

bool BatchEngine::depth_zero_pipelines() const {
  // With a prefix cache a finished row's drafter state is saved with the target's (save_turn),
  // which a drafter still behind the target would get wrong: those engines keep their rounds.
  if (cache_ || !policy_ || !decode_drafts_ || !decode_drafts_->taps().empty() ||
      !target_->pipelines_steps() || options_.spec.verify != spec::VerifyMode::Match)
    return false;
  for (const auto& r : decoding_)
    if (r->needs_logits()) return false;
  return true;
}

void BatchEngine::catch_up_drafter() {
  std::vector<std::vector<int32_t>> behind;
  std::vector<spec::RowPrefill> rows;
  for (size_t b = 0; b < decoding_.size(); ++b) {
    Row& row = *decoding_[b];
    const auto& prompt = row.req.gen.prompt;
    const auto& out = row.result.tokens;
    const int64_t processed = row.processed();
    if (row.drafter_synced >= processed) continue;
    std::vector<int32_t> t;
    for (int64_t i = row.drafter_synced; i < processed; ++i)
      t.push_back(i < static_cast<int64_t>(prompt.size())
                      ? prompt[static_cast<size_t>(i)]
                      : out[static_cast<size_t>(i - static_cast<int64_t>(prompt.size()))]);
    behind.push_back(std::move(t));
    rows.push_back({static_cast<int>(b), {}, nullptr, row.drafter_synced});
  }
  for (size_t k = 0; k < rows.size(); ++k) rows[k].tokens = behind[k];
  if (!rows.empty()) decode_drafts_->prefill(rows);
  for (auto& row : decoding_) row->drafter_synced = row->processed();
}

bool BatchEngine::plain_pipelines() const {
  if (!target_->pipelines_steps() || decode_drafts_ ||
      options_.spec.verify != spec::VerifyMode::Match)
    return false;
  for (const auto& r : decoding_)
    if (r->needs_logits()) return false;
  return true;
}

void BatchEngine::retire_drafter() {
  prefill_drafts_.reset();
  decode_drafts_.reset();
  want_final_ = want_prenorm_ = prompt_hidden_on_device_ = false;
  taps_ = {};
  policy_.reset();
}

void BatchEngine::log_round(RoundRecord r) {
  r.previous_depth = previous_depth_;
  previous_depth_ = r.depth;
  if (round_log_) round_log_->write(r);
}

bool BatchEngine::start_round_clock() {
  const bool untimed = next_round_untimed();
  work_between_rounds_ = false;
  untimed_rounds_ = untimed ? untimed_rounds_ + 1 : 0;
  return untimed;
}

void BatchEngine::drain_timed() {
  if (!chained_ && settled_.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const double wait0 = ops::device_wait_seconds();
  drain();
  std::lock_guard lock(mu_);
  counters_.decode_seconds += seconds_since(t0);
  counters_.decode_wait_seconds += ops::device_wait_seconds() - wait0;
}

void BatchEngine::drain() {
  while (!settled_.empty()) read_settled();
  if (!chained_) return;
  chained_ = false;
  target_->collect_argmax(&collected_);
  TANDEM_CHECK(collected_.size() == chain_ids_.size(), "collected ", collected_.size(),
               " tokens for ", chain_ids_.size(), " rows");
  {
    std::lock_guard lock(mu_);
    ++counters_.rounds;
    ++counters_.pipelined_rounds;
    ++counters_.rounds_by_depth[0];
  }
  for (size_t k = 0; k < chain_ids_.size(); ++k)
    for (auto& row : decoding_)
      if (row->id == chain_ids_[k] && !row->done) {
        ++row->stats.rounds;
        ++row->stats.target_forwards;
        emit(*row, collected_[k], nullptr);
      }
}

void BatchEngine::pipelined_round() {
  const auto t0 = std::chrono::steady_clock::now();
  const double wait0 = ops::device_wait_seconds();
  // A queued step continues only with exactly its rows; otherwise it is collected first.
  bool same = chained_ && chain_ids_.size() == decoding_.size();
  for (size_t r = 0; same && r < decoding_.size(); ++r) same = decoding_[r]->id == chain_ids_[r];
  if (chained_ && !same) drain();
  retire();
  if (decoding_.empty()) return;
  auto queue_step = [&](bool from_argmax) {
    tokens_.clear();
    inputs_.clear();
    sample_rows_.clear();
    bool sampled = false;
    for (const auto& row : decoding_) {
      if (!from_argmax) tokens_.push_back(row->result.tokens.back());
      inputs_.push_back({row->slot, 1, false});
      // The token this step draws has output index tokens.size(); one queued after a step whose
      // token is not read yet draws the next.
      const uint64_t index = row->result.tokens.size() + (from_argmax ? 1 : 0);
      sample_rows_.push_back(ops::sample_row(row->req.gen.sampling, index));
      sampled = sampled || !row->req.gen.sampling.greedy();
    }
    ForwardRequest fwd{tokens_, inputs_, false, false};
    fwd.want_logits = false;
    fwd.want_argmax = true;
    fwd.defer_argmax = true;
    fwd.tokens_from_argmax = from_argmax;
    if (sampled) fwd.sample_rows = sample_rows_;
    target_->forward(fwd, &out_);
  };
  if (!chained_) {
    queue_step(false);
    chain_ids_.clear();
    for (const auto& row : decoding_) chain_ids_.push_back(row->id);
    chained_ = true;
  }
  // Step S is queued. S+1 follows before S's tokens are read unless S may end a row by length,
  // a row is cancelled, or a prompt waits (it takes the next forward).
  bool chain = prefilling_.empty();
  for (const auto& row : decoding_)
    if (row->done || row->sink->cancelled() ||
        static_cast<int64_t>(row->result.tokens.size()) + 1 >= row->req.gen.max_tokens)
      chain = false;
  if (chain) {
    std::lock_guard lock(mu_);
    const bool room = options_.max_rows == 0 || prefilling_.size() + decoding_.size() <
                                                    static_cast<size_t>(options_.max_rows);
    if (!queue_.empty() && room) chain = false;
  }
  if (chain) queue_step(true);
  drain();  // S's tokens: a row stopped by one of them has one extra token computed, dropped
  chained_ = chain;
  std::lock_guard lock(mu_);
  counters_.decode_seconds += seconds_since(t0);
  counters_.decode_wait_seconds += ops::device_wait_seconds() - wait0;
}

uint64_t BatchEngine::settled_index(const Row& row) const {
  return row.result.tokens.size() + settled_.size();
}

bool BatchEngine::settles(int depth) {
  if (!options_.spec.settled_rounds || depth <= 0 || !decode_drafts_ ||
      options_.spec.verify != spec::VerifyMode::Match || options_.spec.sync_phases ||
      !target_->settles_windows() || !taps_.layers.empty() || chained_)
    return false;
  // The rows of the rounds in flight, in order, and room for this round's tokens after theirs:
  // no queued round can outrun a row's max_tokens.
  if (!settled_.empty()) {
    const std::vector<uint64_t>& ids = settled_.back().ids;
    if (ids.size() != decoding_.size()) return false;
    for (size_t r = 0; r < ids.size(); ++r)
      if (decoding_[r]->id != ids[r]) return false;
  }
  const int64_t ahead = static_cast<int64_t>(depth + 1) * static_cast<int64_t>(settled_.size() + 1);
  // A token drafter behind the target (plain steps ran at depth 0) catches up in a host round.
  for (const auto& row : decoding_)
    if (row->done || row->needs_logits() || row->drafter_synced < row->processed() ||
        static_cast<int64_t>(row->result.tokens.size()) + ahead > row->req.gen.max_tokens)
      return false;
  const size_t R = decoding_.size();
  drafts_.resize(R);
  for (size_t r = 0; r < R; ++r) {
    const Row& row = *decoding_[r];
    // Where settled rounds are in flight, pending and first_index are what the host knows: each
    // unread round emits its accepted tokens, which the drafter and target add where the tokens
    // are, and one more (settled_index).
    drafts_[r].pending = row.result.tokens.back();
    drafts_[r].depth = depth;
    drafts_[r].sampling = row.req.gen.sampling;
    drafts_[r].first_index = settled_index(row);
    drafts_[r].want_distribution = false;
  }
  return decode_drafts_->can_settle(drafts_);
}

void BatchEngine::settled_round(int depth) {
  const auto t0 = std::chrono::steady_clock::now();
  const double wait0 = ops::device_wait_seconds();
  const int64_t cold0 = GraphCache::cold_runs();
  const bool other_work = start_round_clock();
  const size_t R = decoding_.size();
  const int64_t n = depth + 1;
  // 1. Draft, left where the chain drew it (pending tokens too, after a settled round).
  if (!decode_drafts_->draft_settled(drafts_, &queued_))
    fail("drafter '", drafter_->id(), "' could not queue a draft it said it could settle");
  const auto t_draft = std::chrono::steady_clock::now();
  // 2. Verify every row's window where its tokens are; only the tokens come back, later.
  tokens_.clear();
  inputs_.clear();
  sample_rows_.clear();
  draft_from_.clear();
  bool sampled = false;
  for (size_t r = 0; r < R; ++r) {
    const Row& row = *decoding_[r];
    tokens_.insert(tokens_.end(), static_cast<size_t>(n), row.result.tokens.back());
    draft_from_.push_back(queued_.pending_slots.empty() ? -1 : queued_.pending_slots[r]);
    TANDEM_CHECK(static_cast<int64_t>(queued_.slots[r].size()) == depth, "row ", r, " drafted ",
                 queued_.slots[r].size(), " of ", depth, " settled proposals");
    draft_from_.insert(draft_from_.end(), queued_.slots[r].begin(), queued_.slots[r].end());
    inputs_.push_back({row.slot, n, true});
    for (int64_t j = 0; j < n; ++j)
      sample_rows_.push_back(ops::sample_row(row.req.gen.sampling, settled_index(row) + j));
    sampled = sampled || !row.req.gen.sampling.greedy();
  }
  ForwardRequest verify{tokens_, inputs_, true, false, false};
  verify.want_logits = false;
  verify.want_argmax = true;
  verify.defer_argmax = true;
  if (sampled) verify.sample_rows = sample_rows_;
  verify.draft_ids = queued_.ids;
  verify.draft_from = draft_from_;
  target_->forward(verify, &out_);
  const auto t_verify = std::chrono::steady_clock::now();
  // 3. Accept and commit where the tokens are: the target's rows, then the drafter's.
  accepted_dev_.grow_to(static_cast<int64_t>(R));
  next_dev_.grow_to(static_cast<int64_t>(R));
  target_->accept_windows(accepted_dev_.data(), next_dev_.data(), queued_.counts);
  settled_rows_.resize(R);
  for (size_t r = 0; r < R; ++r) settled_rows_[r] = {decoding_[r]->slot, static_cast<int32_t>(r)};
  target_->settle_windows(settled_rows_, accepted_dev_.data());
  spec::SettledVerify v;
  v.accepted = accepted_dev_.data();
  v.next = next_dev_.data();
  if (taps_.hidden) v.hidden = target_->device_hidden(*taps_.hidden == spec::HiddenTap::PreNorm);
  v.depth = depth;
  decode_drafts_->settle(v);
  SettledRound round;
  for (const auto& row : decoding_) round.ids.push_back(row->id);
  round.depth = depth;
  settled_.push_back(std::move(round));
  const auto t_settle = std::chrono::steady_clock::now();
  // 4. The round before this one, whose work the device has done or is finishing.
  const bool reads = settled_.size() > 1;
  if (reads) read_settled();
  const double seconds = seconds_since(t0);
  // In steady state each call queues one round and reads one: its time is a round's (the
  // acceptance is the read round's).
  const double round_time = timed(seconds, cold0, other_work);
  const bool learns = policy_ && reads && decode_drafts_;
  if (learns)
    policy_->record(static_cast<int64_t>(R), depth, round_time, drafted_pos_, accepted_pos_);
  RoundRecord line = round_record(R, depth, seconds, wait0, cold0);
  line.timed = learns && round_time > 0.0;
  line.draft = between(t0, t_draft);
  line.verify = between(t_draft, t_verify);
  line.accept = seconds_since(t_settle);
  line.commit = between(t_verify, t_settle);
  log_round(line);
  std::lock_guard lock(mu_);
  ++counters_.settled_rounds;
  counters_.decode_seconds += line.seconds;
  counters_.decode_wait_seconds += line.wait;
  counters_.draft_seconds += line.draft;
  counters_.verify_seconds += line.verify;
  counters_.commit_seconds += line.commit;
  counters_.accept_seconds += line.accept;
}

void BatchEngine::read_settled() {
  const SettledRound round = std::move(settled_.front());
  settled_.pop_front();
  const size_t R = round.ids.size();
  TANDEM_CHECK(R == decoding_.size(), "a settled round of ", R, " rows, ", decoding_.size(),
               " decoding");
  const int64_t n = round.depth + 1;
  target_->collect_argmax(&collected_);
  TANDEM_CHECK(static_cast<int64_t>(collected_.size()) == static_cast<int64_t>(R) * n, "collected ",
               collected_.size(), " tokens for ", R, " windows of ", n);
  decode_drafts_->settled_proposals(&proposals_);
  const int64_t V = target_->vocab_size();
  keeps_.clear();
  std::vector<int>& accepted = settled_accepted_;
  accepted.resize(R);
  drafted_pos_.assign(static_cast<size_t>(depth_), 0);
  accepted_pos_.assign(static_cast<size_t>(depth_), 0);
  for (size_t r = 0; r < R; ++r) {
    Row& row = *decoding_[r];
    TANDEM_CHECK(row.id == round.ids[r], "settled round row ", r, " is another request");
    const auto& props = proposals_[r].tokens;
    for (int32_t p : props)
      if (p < 0 || p >= V) fail("drafter '", drafter_->id(), "' proposed token id ", p);
    if (static_cast<int64_t>(props.size()) >= n)
      fail("drafter '", drafter_->id(), "' settled ", props.size(), " proposals in a window of ",
           n);
    // A window holds pending, the proposals, then padding the walk never reaches.
    const std::span<const int32_t> verified(collected_.data() + r * n, props.size() + 1);
    for (int32_t t : verified)
      if (t < 0) fail("verify: a logits row of request row ", r, " holds NaN or +inf");
    const spec::AcceptOutcome outcome = spec::accept_walk_match(verified, props);
    accepted[r] = outcome.accepted;
    keeps_.push_back({row.slot, 1 + outcome.accepted});
    if (row.done) continue;  // ended by an earlier round's token: its later ones are dropped
    count_round(row, static_cast<int64_t>(props.size()), outcome.accepted);
    for (int32_t t : outcome.emitted)
      if (!emit(row, t, nullptr)) break;
  }
  target_->resolve_settled(keeps_);
  decode_drafts_->resolve(accepted);
  for (auto& row : decoding_) row->drafter_synced = row->processed();
  {
    std::lock_guard lock(mu_);
    add_round_counters(round.depth);
  }
  // The health probe, as for host rounds: a collapsed drafter ends settled rounds (the one still
  // queued is read first) and drafts no more.
  if (probe_collapsed()) {
    while (!settled_.empty()) read_settled();
    release_collapsed_drafter();
  }
}

void BatchEngine::count_round(Row& row, int64_t proposals, int accepted) {
  SpecStats& st = row.stats;
  ++st.rounds;
  ++st.target_forwards;
  st.drafted += proposals;
  st.accepted += accepted;
  for (int j = 0; j < accepted; ++j) {
    ++st.accepted_by_position[static_cast<size_t>(j)];
    ++accepted_pos_[static_cast<size_t>(j)];
  }
  for (int64_t j = 0; j < proposals; ++j) {
    ++st.drafted_by_position[static_cast<size_t>(j)];
    ++drafted_pos_[static_cast<size_t>(j)];
  }
}

void BatchEngine::add_round_counters(int depth) {
  ++counters_.rounds;
  ++counters_.rounds_by_depth[static_cast<size_t>(depth)];
  counters_.drafter_first_acceptance = health_.acceptance();
  for (int j = 0; j < depth_; ++j) {
    counters_.drafted_by_position[static_cast<size_t>(j)] += drafted_pos_[static_cast<size_t>(j)];
    counters_.accepted_by_position[static_cast<size_t>(j)] += accepted_pos_[static_cast<size_t>(j)];
  }
}

void BatchEngine::set_warmup(bool on) {
  warmup_ = on;
  if (policy_) policy_->set_warmup(on);
}

bool BatchEngine::probe_collapsed() {
  if (!options_.spec.health_probe || warmup_ || draft_depth_ == 0 || drafted_pos_.empty() ||
      !health_.record(drafted_pos_[0], accepted_pos_[0]))
    return false;
  draft_depth_ = 0;
  return true;
}

void BatchEngine::release_collapsed_drafter() {
  const std::string msg = spec::drafter_collapse_message(drafter_->id(), health_);
  if (options_.on_warning)
    options_.on_warning(msg);
  else
    std::fprintf(stderr, "tandem: warning: %s\n", msg.c_str());
  retire_drafter();
  std::lock_guard lock(mu_);
  counters_.drafter_disabled = 1;
}

void BatchEngine::round() {
  size_t R = decoding_.size();
  if (R == 0) return;
  // A draft queued ahead (queue_draft_ahead): its round runs now, with the rows it drafted for.
  const bool ahead = draft_ahead_;
  draft_ahead_ = false;
  if (ahead)
    TANDEM_CHECK(drafts_.size() == R, "a draft queued ahead for ", drafts_.size(), " rows, ", R,
                 " decoding");
  int round_depth = ahead ? ahead_depth_ : draft_depth_;
  const int chosen = chosen_rows_ == R ? chosen_depth_ : -1;
  chosen_depth_ = -1;
  if (!ahead) {
    if (plain_pipelines()) return pipelined_round();
    // With adaptive depth the policy picks this round's depth (never above what the probe
    // allows). A token drafter needs no forward's hiddens, so a round at depth 0 runs as a
    // pipelined plain step and the drafter takes in the tokens it missed before it next drafts.
    if (policy_ && round_depth > 0)
      round_depth = std::min(
          round_depth,
          chosen >= 0 ? chosen : policy_->choose(static_cast<int64_t>(R), !next_round_untimed()));
    if (settles(round_depth)) return settled_round(round_depth);
    if (!settled_.empty()) {  // not settled: the host reads the queued rounds first
      drain_timed();
      retire();
      R = decoding_.size();
      if (R == 0) return;
    }
    if (round_depth == 0 && draft_depth_ > 0 && depth_zero_pipelines()) {
      // What a steady depth-0 round costs: one step. A round that starts a chain waits for its
      // first step on a GPU, about one step too; on the CPU the step it queues ahead runs at
      // once, so it took two. (Were starts left out, a depth 0 chosen only now and then would
      // never be measured, and its cost would stay an extrapolation from the drafted depths.)
      const bool starts = !chained_;
      const auto t = std::chrono::steady_clock::now();
      const int64_t cold = GraphCache::cold_runs();
      const bool other_work = start_round_clock();
      const double wait0 = ops::device_wait_seconds();
      pipelined_round();
      const double steps = starts && chained_ && ops::backend() == ops::Backend::Cpu ? 2.0 : 1.0;
      const double seconds = seconds_since(t);
      const double round_time = timed(seconds / steps, cold, other_work);
      policy_->record(static_cast<int64_t>(R), 0, round_time, {}, {});
      RoundRecord line = round_record(R, 0, seconds, wait0, cold);
      line.timed = round_time > 0.0;
      log_round(line);
      return;
    }
    drain_timed();
    // Plain steps collected just now may have ended rows (EOS, a stop string).
    retire();
    R = decoding_.size();
    if (R == 0) return;
    if (decode_drafts_ && decode_drafts_->taps().empty()) catch_up_drafter();
  }
  const int64_t V = target_->vocab_size(), H = target_->hidden_size();
  const auto t0 = std::chrono::steady_clock::now();
  const double wait0 = ops::device_wait_seconds();
  const int64_t cold0 = GraphCache::cold_runs();
  const bool other_work = start_round_clock();
  const bool rejection = options_.spec.verify == spec::VerifyMode::Rejection;
  // The end of each phase; with sync_phases after the device finished the phase's work.
  auto phase_end = [&] {
    if (options_.spec.sync_phases) ops::synchronize();
    return std::chrono::steady_clock::now();
  };

  // 1. Draft (every row at the round's depth, queue_draft). A drafter that can leaves its proposals
  // in backend memory: the verify forward reads them there, and the host reads them with the
  // verify's tokens (one wait per round instead of two).
  proposals_.assign(R, {});
  bool queued = ahead;
  if (decode_drafts_ && !ahead) {
    queued = queue_draft(round_depth);
    if (!queued) {
      decode_drafts_->draft(drafts_, &proposals_);
      TANDEM_CHECK(proposals_.size() == R, "drafter returned ", proposals_.size(), " rows");
    }
  }
  const auto t_draft = phase_end();
  // 2. Verify every row's window [pending, proposals...] in one forward.
  tokens_.clear();
  inputs_.clear();
  windows_.resize(R);
  bool need_logits = rejection;
  bool sampled = false;
  sample_rows_.clear();
  draft_from_.clear();
  for (size_t r = 0; r < R; ++r) {
    const Row& row = *decoding_[r];
    if (queued) {
      // Placeholders (the pending token) where the forward takes the drafted ids.
      const auto& slots = queued_.slots[r];
      proposals_[r].tokens.assign(slots.size(), row.result.tokens.back());
      draft_from_.push_back(-1);
      draft_from_.insert(draft_from_.end(), slots.begin(), slots.end());
    }
    if (decode_drafts_ && static_cast<int>(proposals_[r].tokens.size()) > drafts_[r].depth)
      fail("drafter '", drafter_->id(), "' proposed ", proposals_[r].tokens.size(),
           " tokens for depth ", drafts_[r].depth);
    for (int32_t p : proposals_[r].tokens)
      if (p < 0 || p >= V) fail("drafter '", drafter_->id(), "' proposed token id ", p);
    windows_[r].clear();
    windows_[r].push_back(row.result.tokens.back());
    windows_[r].insert(windows_[r].end(), proposals_[r].tokens.begin(), proposals_[r].tokens.end());
    tokens_.insert(tokens_.end(), windows_[r].begin(), windows_[r].end());
    // A window of the pending token alone has nothing to roll back: it runs as a plain decode
    // row (same numbers), which spares the recurrent state's per-position copies.
    const bool speculative = windows_[r].size() > 1;
    inputs_.push_back({row.slot, static_cast<int64_t>(windows_[r].size()), speculative});
    need_logits = need_logits || row.needs_logits();
    // Window position j draws the token of output index tokens.size() + j (DESIGN.md 5.1).
    for (size_t j = 0; j < windows_[r].size(); ++j)
      sample_rows_.push_back(ops::sample_row(row.req.gen.sampling, row.result.tokens.size() + j));
    sampled = sampled || !row.req.gen.sampling.greedy();
  }
  ForwardRequest verify{tokens_, inputs_, true, want_final_, want_prenorm_};
  verify.tap_layers = taps_.layers;
  verify.want_logits = need_logits;
  verify.want_argmax = !need_logits;
  if (!need_logits && sampled) verify.sample_rows = sample_rows_;
  if (queued && queued_.ids) {  // (a round at depth 0 drafted nothing)
    verify.draft_ids = queued_.ids;
    verify.draft_from = draft_from_;
  }
  // The commit on the device (SpecOptions::device_commit): queued behind the verify's reads, so
  // the device walks and commits the windows while the host waits for the tokens and walks them.
  settled_rows_.clear();
  for (size_t r = 0; r < R; ++r)
    if (inputs_[r].speculative)
      settled_rows_.push_back({decoding_[r]->slot, static_cast<int32_t>(r)});
  const bool device_commit = options_.spec.device_commit && !need_logits && !cache_ &&
                             options_.spec.verify == spec::VerifyMode::Match &&
                             !options_.spec.sync_phases && target_->settles_windows() &&
                             !settled_rows_.empty();
  if (device_commit) {
    commit_accepted_dev_.grow_to(static_cast<int64_t>(R));
    commit_next_dev_.grow_to(static_cast<int64_t>(R));
    verify.after_reads = [this] {
      target_->accept_windows(commit_accepted_dev_.data(), commit_next_dev_.data(), nullptr);
      target_->settle_windows(settled_rows_, commit_accepted_dev_.data());
    };
  }
  try {
    target_->forward(verify, &out_);
  } catch (const std::exception&) {
    // A draw that failed on NaN logits fed the verify NaN: name the drafter, not the target.
    if (queued) decode_drafts_->finish_queued(&proposals_);
    throw;
  }
  if (queued) {
    decode_drafts_->finish_queued(&proposals_);
    TANDEM_CHECK(proposals_.size() == R, "drafter returned ", proposals_.size(), " rows");
    for (size_t r = 0; r < R; ++r) {
      TANDEM_CHECK(proposals_[r].tokens.size() == windows_[r].size() - 1, "row ", r, " drafted ",
                   proposals_[r].tokens.size(), " of ", windows_[r].size() - 1, " queued tokens");
      for (int32_t p : proposals_[r].tokens)
        if (p < 0 || p >= V) fail("drafter '", drafter_->id(), "' proposed token id ", p);
      std::copy(proposals_[r].tokens.begin(), proposals_[r].tokens.end(), windows_[r].begin() + 1);
    }
  }
  const auto t_verify = phase_end();

  // 3. Accept walk per row, emitting as it goes (EOS, max tokens and stop strings end a request
  // mid-window). A row that fails here ends alone; its window is discarded with its slot.
  keeps_.clear();
  settled_keeps_.clear();
  verified_.assign(R, {});
  int64_t t = 0;
  drafted_pos_.assign(static_cast<size_t>(depth_), 0);
  accepted_pos_.assign(static_cast<size_t>(depth_), 0);
  for (size_t r = 0; r < R; ++r) {
    Row& row = *decoding_[r];
    const size_t n = windows_[r].size();
    const uint64_t first_index = row.result.tokens.size();
    verified_[r].window = windows_[r];
    verified_[r].hidden = nullptr;
    verified_[r].accepted = 0;
    verified_[r].next_pending = windows_[r][0];
    spec::AcceptOutcome outcome;
    try {
      if (!need_logits) {
        outcome = spec::accept_walk_match(std::span(out_.argmax).subspan(t, n),
                                          std::span(windows_[r]).subspan(1));
      } else {
        std::span<const float> logits(out_.logits.data() + t * V, n * static_cast<size_t>(V));
        outcome = spec::accept_walk(logits, V, std::span(windows_[r]).subspan(1), proposals_[r].q,
                                    row.req.gen.sampling, first_index, options_.spec.verify);
      }
    } catch (const std::exception& e) {
      finish(row, RequestEnd::Failed, e.what());
      // Whatever the device kept of a failed row's window, the row leaves with its slot.
      if (device_commit && n > 1) settled_keeps_.push_back({row.slot, 1});
      t += static_cast<int64_t>(n);
      continue;
    }
    // The device's walk is this walk: it kept every accepted proposal, also where the row ends
    // mid-window (its state is then discarded with the row: no prefix cache to save it).
    if (device_commit && n > 1) settled_keeps_.push_back({row.slot, 1 + outcome.accepted});
    count_round(row, static_cast<int64_t>(n - 1), outcome.accepted);
    size_t emitted = 0;
    while (emitted < outcome.emitted.size()) {
      const float* logits = need_logits ? out_.logits.data() + (t + emitted) * V : nullptr;
      if (!emit(row, outcome.emitted[emitted++], logits)) break;
    }
    // A row that ended mid-window (EOS, max_tokens, a stop) keeps only what it emitted, so its
    // state holds exactly its tokens (a finished turn the prefix cache saves).
    const int kept = static_cast<int>(emitted);
    if (n > 1) keeps_.push_back({row.slot, kept});
    verified_[r].accepted = kept - 1;
    verified_[r].next_pending = outcome.emitted[emitted - 1];
    t += static_cast<int64_t>(n);
  }
  // The health probe: a drafter whose first proposals stopped being accepted drafts no more
  // (depth 0 keeps it aligned). Only what rounds propose changes, never what they emit.
  if (probe_collapsed()) release_collapsed_drafter();
  const auto t_accept = phase_end();
  // 4. Commit: the target keeps pending + accepted proposals (queued on the device already, or
  // now); the drafter follows.
  if (device_commit)
    target_->resolve_settled(settled_keeps_);
  else
    target_->commit_windows(keeps_);
  if (decode_drafts_) {
    const float* hidden = tapped_rows();
    const int64_t width = taps_.width(H);
    int64_t off = 0;
    for (size_t r = 0; r < R; ++r) {
      verified_[r].hidden = hidden ? hidden + off * width : nullptr;
      off += static_cast<int64_t>(windows_[r].size());
    }
    decode_drafts_->commit(verified_);
    for (auto& row : decoding_) row->drafter_synced = row->processed();
  }
  const auto t_commit = phase_end();
  // The next round's draft, queued now where nothing can change the rows before it: its time is
  // this round's (the policy's cost of a round stays one draft, one verify and one commit).
  queue_draft_ahead();
  const auto t_ahead = std::chrono::steady_clock::now();
  const double seconds = seconds_since(t0);
  const double round_time = timed(seconds, cold0, other_work);
  if (policy_)
    policy_->record(static_cast<int64_t>(R), round_depth, round_time, drafted_pos_, accepted_pos_);
  RoundRecord line = round_record(R, round_depth, seconds, wait0, cold0);
  line.drafted_ahead = ahead;
  line.timed = policy_ && round_time > 0.0;
  line.draft = between(t0, t_draft);
  line.verify = between(t_draft, t_verify);
  line.accept = between(t_verify, t_accept);
  line.commit = between(t_accept, t_commit);
  line.next_draft = between(t_commit, t_ahead);
  log_round(line);
  std::lock_guard lock(mu_);
  if (queued) ++counters_.queued_draft_rounds;
  if (ahead) ++counters_.drafted_ahead_rounds;
  if (device_commit) ++counters_.device_commit_rounds;
  counters_.decode_seconds += line.seconds;
  counters_.decode_wait_seconds += line.wait;
  counters_.draft_seconds += line.draft + line.next_draft;
  counters_.verify_seconds += line.verify;
  counters_.accept_seconds += line.accept;
  counters_.commit_seconds += line.commit;
  add_round_counters(round_depth);
}

bool BatchEngine::queue_draft(int depth) {
  const size_t R = decoding_.size();
  drafts_.resize(R);
  // Every row drafts `depth`, also one a few tokens short of its max_tokens: its window may reach
  // past them (its state holds depth + 1 positions more, tokens_needed) and the walk emits nothing
  // past them. A round's windows then have one shape per (rows, depth), whose CUDA graphs later
  // rounds replay; windows cut to each row's room made every run's end a new mix of shapes, each
  // an eager run and a capture (milliseconds of host time) that no round replayed.
  for (size_t r = 0; r < R; ++r) {
    const Row& row = *decoding_[r];
    drafts_[r].pending = row.result.tokens.back();
    drafts_[r].depth = depth;
    drafts_[r].sampling = row.req.gen.sampling;
    drafts_[r].first_index = row.result.tokens.size();
    drafts_[r].want_distribution = options_.spec.verify == spec::VerifyMode::Rejection;
  }
  return target_->takes_draft_ids() && !options_.spec.sync_phases &&
         decode_drafts_->draft_queued(drafts_, &queued_);
}

void BatchEngine::queue_draft_ahead() {
  // Settled rounds and depth-0 pipelining take their own paths; a round at depth 0 drafts nothing.
  if (!options_.spec.draft_ahead || !decode_drafts_ || draft_depth_ == 0 ||
      options_.spec.settled_rounds || options_.spec.sync_phases || !target_->takes_draft_ids() ||
      work_queued() || !prefilling_.empty() || target_->prompt_active() || decoding_.empty())
    return;
  for (const auto& row : decoding_)
    if (row->done || row->sink->cancelled()) return;
  {
    std::lock_guard lock(mu_);
    if (!queue_.empty()) return;
  }
  const size_t R = decoding_.size();
  int depth = draft_depth_;
  if (policy_) depth = std::min(depth, policy_->choose(static_cast<int64_t>(R)));
  if (depth == 0 || !queue_draft(depth)) {  // the next round takes this choice as it is
    chosen_depth_ = policy_ ? depth : -1;
    chosen_rows_ = R;
    return;
  }
  draft_ahead_ = true;
  ahead_depth_ = depth;
}

void BatchEngine::step_rows() {
  // A queued plain step or settled round is collected before anything changes the rows or takes
  // a forward.
  if (work_queued()) {
    bool change = !prefilling_.empty();
    for (const auto& r : decoding_) change = change || r->sink->cancelled();
    {
      std::lock_guard lock(mu_);
      change = change || !queue_.empty();
    }
    if (change) {
      try {
        drain_timed();
      } catch (const std::exception& e) {
        abandon_chain();
        fail_rows(decoding_, std::string("decode round failed: ") + e.what());
      }
    }
  }
  // A cancelled row of the prefill forward in flight: the forward runs its remaining layers
  // now, so the row's slot is free to close (one long step, only on cancellation).
  if (target_->prompt_active()) {
    bool cancel = false;
    for (const auto& r : prefilling_) cancel = cancel || (in_flight(*r) && r->sink->cancelled());
    if (cancel) {
      try {
        advance_prefill(true);
      } catch (const std::exception& e) {
        target_->abandon_prompt();
        fail_rows(prefilling_, std::string("prefill failed: ") + e.what());
      }
    }
  }
  for (auto* rows : {&prefilling_, &decoding_})
    for (auto& r : *rows)
      if (r->sink->cancelled()) finish(*r, RequestEnd::Cancelled);
  retire();
  admit();
  try {
    prefill_step();
  } catch (const std::exception& e) {
    target_->abandon_prompt();
    fail_rows(prefilling_, std::string("prefill failed: ") + e.what());
  }
  retire();
  round_or_fail();
  retire();
}

void BatchEngine::round_or_fail() {
  try {
    round();
  } catch (const std::exception& e) {
    abandon_chain();
    fail_rows(decoding_, std::string("decode round failed: ") + e.what());
  }
}

bool BatchEngine::step() {
  const ops::ContextScope scope(target_->context());
  const auto t_step = std::chrono::steady_clock::now();
  const int64_t cold_before = GraphCache::cold_runs();
  const int64_t evicted_before = GraphCache::evicted_graphs();
  double counted_before = 0;
  {
    std::lock_guard lock(mu_);
    counted_before =
        counters_.prefill_seconds + counters_.drafter_prefill_seconds + counters_.decode_seconds;
  }
  if (draft_ahead_) {
    // A round whose draft is already queued runs first, with exactly its rows; requests waiting,
    // cancelled or finished are taken care of in the next step (that round queued nothing ahead).
    round_or_fail();
    retire();
  } else {
    step_rows();
  }
  // Every row of the queued step stopped on its last token: nothing continues it.
  if (work_queued() && decoding_.empty()) {
    try {
      drain_timed();
    } catch (const std::exception&) {
      abandon_chain();
    }
  }
  publish_counters();
  std::lock_guard lock(mu_);
  const double counted =
      counters_.prefill_seconds + counters_.drafter_prefill_seconds + counters_.decode_seconds;
  counters_.row_change_seconds += seconds_since(t_step) - (counted - counted_before);
  counters_.cold_graph_runs += GraphCache::cold_runs() - cold_before;
  counters_.graph_evictions += GraphCache::evicted_graphs() - evicted_before;
  return !prefilling_.empty() || !decoding_.empty() || !queue_.empty();
}

void BatchEngine::abandon_chain() {
  chained_ = false;
  if (draft_ahead_) {
    draft_ahead_ = false;
    try {
      std::vector<spec::DraftProposal> dropped;
      decode_drafts_->finish_queued(&dropped);
    } catch (...) {  // the error being handled already says what went wrong
    }
  }
  if (!settled_.empty()) {
    settled_.clear();
    if (decode_drafts_) decode_drafts_->drop_settled();
  }
  try {
    target_->drop_deferred_argmax();
  } catch (...) {  // the error being handled already says what went wrong
  }
}

void BatchEngine::run_to_completion() {
  while (step()) {
  }
}

void BatchEngine::serve(const std::string& shutdown_reason) {
  for (;;) {
    {
      std::unique_lock lock(mu_);
      if (prefilling_.empty() && decoding_.empty())
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) break;
    }
    step();
  }
  if (work_queued()) abandon_chain();
  target_->abandon_prompt();  // its rows are all cancelled below
  std::deque<Pending> left;
  {
    std::lock_guard lock(mu_);
    left.swap(queue_);
  }
  for (Pending& p : left) {
    Row row;
    row.req = std::move(p.request);
    row.sink = std::move(p.sink);
    finish(row, RequestEnd::Cancelled, shutdown_reason);
  }
  for (auto* rows : {&prefilling_, &decoding_})
    for (auto& r : *rows) finish(*r, RequestEnd::Cancelled, shutdown_reason);
  retire();
  publish_counters();
}

}  // namespace tandem
