// The live prefix cache (engine/prefix_cache.h): shared KV blocks held by reference, boundaries
// restored into new rows with the drafter's checkpoint, eviction under a byte budget, and the
// promise that matters — a request served from a cached prefix gets exactly the tokens it gets on
// a cold engine, with the same speculation statistics (the drafter resumes at full strength).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "demo_model.h"
#include "recording_sink.h"
#include "tandem/core/error.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/prefix_cache.h"
#include "tandem/spec/qwen_mtp.h"
#include "test_util.h"

namespace tandem {
namespace {

test::DemoModel& demo() {
  static test::DemoModel* f = test::load_demo_model().release();
  return *f;
}

std::vector<int32_t> sample_tokens(size_t n) {
  std::ifstream in(test::kDemoDir + "/heldout_sample.py");
  std::stringstream ss;
  ss << in.rdbuf();
  auto ids = demo().tok->encode(ss.str());
  EXPECT_GE(ids.size(), n);
  ids.resize(n);
  return ids;
}

std::vector<int32_t> first(const std::vector<int32_t>& v, size_t n) {
  return {v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n)};
}

GenerateRequest request(std::vector<int32_t> prompt, float temperature, uint64_t seed,
                        int64_t max_tokens) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = temperature;
  r.sampling.top_p = temperature > 0 ? 0.9f : 1.0f;
  r.sampling.seed = seed;
  r.max_tokens = max_tokens;
  return r;
}

using Recorder = test::RecordingSink;

// "mtp_settled": an MTP drafter in the target's context, its rounds settled on the device;
// "ngram_settled": the n-gram drafter, its rounds settled there.
const spec::DraftProvider* drafter_named(const std::string& name) {
  static const auto shared = [] {
    const ops::ContextScope scope(demo().model->context());
    return spec::QwenMtpProvider::from_target(*demo().target);
  }();
  if (name == "mtp_settled") return shared.get();
  if (name == "ngram" || name == "ngram_settled") return demo().ngram.get();
  return name == "mtp" ? demo().mtp.get() : nullptr;
}

// Runs one request to completion on `engine` (alone in it, after the earlier ones finished).
RequestOutcome serve(BatchEngine& engine, const GenerateRequest& r, std::vector<int32_t>* tokens) {
  const RequestOutcome o = test::serve_alone(engine, r, tokens);
  EXPECT_EQ(o.end, RequestEnd::Finished) << o.error;
  return o;
}

EngineOptions options(size_t cache_bytes, bool settled = false) {
  EngineOptions o;
  o.spec.depth = 3;
  o.spec.settled_rounds = settled;
  o.spec.prefill_chunk = 64;
  o.prefill_budget = 128;
  o.max_rows = 4;
  o.kv_blocks = 300;
  o.prefix_cache_bytes = cache_bytes;
  return o;
}

// --- Shared blocks -------------------------------------------------------------------------------

TEST(PrefixBlocks, SharedBlocksReturnToThePoolWithTheirLastHolder) {
  auto& d = demo();
  Qwen35State st(d.model->config());
  st.set_capacity({2, 6, 4});
  const int a = st.open_row();
  st.reserve(a, 40);  // blocks for positions 0..47
  st.set_length(a, 40);
  const std::vector<int32_t> blocks = st.block_table(a);
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_EQ(st.free_block_count(), 3);
  // Fill the tail block with recognisable keys so that the copy can be checked.
  ops::KVLayerView kv = st.kv_layer(0);
  for (int64_t p = 32; p < 40; ++p)
    for (size_t i = 0; i < kv.row_bytes(); ++i)
      kv.key(blocks[2], p % 16)[i] = static_cast<std::byte>(p * 7 + static_cast<int64_t>(i));

  st.retain_blocks(std::span(blocks).first(2));  // a cache entry holds the two full blocks
  const int b = st.open_row();
  std::vector<float> linear(static_cast<size_t>(st.linear_state_floats()), 0.5f);
  st.attach_prefix(b, blocks, 40, linear.data());
  EXPECT_EQ(st.length(b), 40);
  ASSERT_EQ(st.block_table(b).size(), 3u);
  EXPECT_EQ(st.block_table(b)[0], blocks[0]);
  EXPECT_EQ(st.block_table(b)[1], blocks[1]);
  const int32_t own = st.block_table(b)[2];
  EXPECT_NE(own, blocks[2]) << "the tail block is written by the new row: it must be a copy";
  for (int64_t p = 32; p < 40; ++p)
    EXPECT_EQ(0, std::memcmp(kv.key(own, p % 16), kv.key(blocks[2], p % 16), kv.row_bytes()));
  EXPECT_EQ(st.linear_state(b)[0], 0.5f);
  EXPECT_EQ(st.block_holders(blocks[0]), 3);  // row a, the entry, row b
  EXPECT_EQ(st.free_block_count(), 2);

  st.close_row(a);
  EXPECT_EQ(st.free_block_count(), 3);  // only a's tail block was a's alone
  st.close_row(b);
  EXPECT_EQ(st.free_block_count(), 4);
  st.release_blocks(std::span(blocks).first(2));
  EXPECT_EQ(st.free_block_count(), 6);
  EXPECT_THROW(st.release_blocks(std::span(blocks).first(1)), std::exception);
}

TEST(PrefixBlocks, AFailedTailCopyChangesNothing) {
  auto& d = demo();
  Qwen35State st(d.model->config());
  st.set_capacity({2, 3, 4});
  const int a = st.open_row();
  st.reserve(a, 40);
  st.set_length(a, 40);
  const std::vector<int32_t> blocks = st.block_table(a);
  const int b = st.open_row();
  std::vector<float> linear(static_cast<size_t>(st.linear_state_floats()), 0.0f);
  EXPECT_THROW(st.attach_prefix(b, blocks, 40, linear.data()), Error);  // no block to copy into
  EXPECT_EQ(st.length(b), 0);
  EXPECT_TRUE(st.block_table(b).empty());
  EXPECT_EQ(st.block_holders(blocks[0]), 1);
  st.attach_prefix(b, std::span(blocks).first(2), 32, linear.data());  // aligned: no copy
  EXPECT_EQ(st.block_holders(blocks[0]), 2);
}

// --- The cache on its own ------------------------------------------------------------------------

// Prefills `prompt` into a new row of `st` and returns the slot.
int prefilled_row(Qwen35State& st, std::span<const int32_t> prompt) {
  const int slot = st.open_row();
  const RowInput row{slot, static_cast<int64_t>(prompt.size()), false};
  ForwardRequest f{prompt, std::span(&row, 1), false, false};
  f.prompt = true;
  ForwardOutput out;
  demo().model->forward(st, f, &out);
  return slot;
}

spec::CheckpointPtr checkpoint(const std::string& ns, int64_t tokens) {
  auto c = std::make_shared<spec::Checkpoint>();
  c->ns = ns;
  c->schema = "test";
  c->processed_tokens = tokens;
  return c;
}

TEST(PrefixCache, LongestSavedPrefixLeavingOneTokenWithTheRightAttachment) {
  auto& d = demo();
  Qwen35State st(d.model->config());
  const auto prompt = sample_tokens(100);
  PrefixCache cache(st, size_t{1} << 30, Qwen35State::block_bytes(d.model->config()));
  const int slot = prefilled_row(st, first(prompt, 48));
  ASSERT_TRUE(cache.insert(first(prompt, 48), slot, checkpoint("mtp-ns", 48)));
  st.close_row(slot);
  const int slot2 = prefilled_row(st, first(prompt, 70));
  ASSERT_TRUE(cache.insert(first(prompt, 70), slot2, checkpoint("mtp-ns", 70)));
  st.close_row(slot2);
  EXPECT_EQ(cache.boundaries(), (std::vector<int64_t>{48, 70}));

  EXPECT_EQ(cache.lookup(prompt, "mtp-ns", false).tokens, 70);
  EXPECT_EQ(cache.lookup(first(prompt, 71), "mtp-ns", false).tokens, 70);
  // A prompt equal to a saved prefix needs its last token's logits: the shorter one serves.
  EXPECT_EQ(cache.lookup(first(prompt, 70), "mtp-ns", false).tokens, 48);
  EXPECT_EQ(cache.lookup(first(prompt, 48), "mtp-ns", false).tokens, 0);
  auto diverged = prompt;
  diverged[60] = diverged[60] == 7 ? 8 : 7;
  EXPECT_EQ(cache.lookup(diverged, "mtp-ns", false).tokens, 48);

  // Another drafter namespace: usable for the target alone by a drafter that adopts the prefix
  // without changing the output, skipped otherwise; no drafter uses any entry.
  const auto hit = cache.lookup(prompt, "mtp-ns", false);
  ASSERT_TRUE(hit.draft);
  EXPECT_EQ(hit.draft->processed_tokens, 70);
  EXPECT_EQ(cache.lookup(prompt, "other-ns", false).tokens, 0);
  const auto tokens_only = cache.lookup(prompt, "other-ns", true);
  EXPECT_EQ(tokens_only.tokens, 70);
  EXPECT_FALSE(tokens_only.draft);
  EXPECT_EQ(cache.lookup(prompt, "", false).tokens, 70);
  // The same boundary saved again by the other drafter gives the entry its checkpoint.
  const int again = prefilled_row(st, first(prompt, 70));
  ASSERT_TRUE(cache.insert(first(prompt, 70), again, checkpoint("other-ns", 70)));
  st.close_row(again);
  EXPECT_EQ(cache.boundaries(), (std::vector<int64_t>{48, 70}));
  const auto upgraded = cache.lookup(prompt, "other-ns", false);
  EXPECT_EQ(upgraded.tokens, 70);
  ASSERT_TRUE(upgraded.draft);
  EXPECT_EQ(upgraded.draft->ns, "other-ns");

  // A checkpoint of another length is a bug of the caller, refused.
  const int slot3 = prefilled_row(st, first(prompt, 80));
  EXPECT_THROW(cache.insert(first(prompt, 80), slot3, checkpoint("mtp-ns", 79)), std::exception);
  EXPECT_THROW(cache.insert(first(prompt, 79), slot3, checkpoint("mtp-ns", 79)), std::exception);
  st.close_row(slot3);
}

TEST(PrefixCache, RestoredRowContinuesBitwiseLikeTheRowThatSavedIt) {
  auto& d = demo();
  const auto prompt = sample_tokens(120);
  // Reference: one row prefilled 120 tokens in one forward.
  ForwardOutput want;
  {
    Qwen35State st(d.model->config());
    const int slot = st.open_row();
    const RowInput row{slot, 120, false};
    ForwardRequest f{prompt, std::span(&row, 1), false, false};
    f.prompt = true;
    d.model->forward(st, f, &want);
  }
  for (int64_t boundary : {64, 75}) {  // block-aligned, and a tail copied into the new row
    Qwen35State st(d.model->config());
    PrefixCache cache(st, size_t{1} << 30, Qwen35State::block_bytes(d.model->config()));
    const int saver = prefilled_row(st, first(prompt, static_cast<size_t>(boundary)));
    ASSERT_TRUE(cache.insert(first(prompt, static_cast<size_t>(boundary)), saver, nullptr));
    // The saver goes on writing its own tail; the entry must not see it.
    {
      const RowInput row{saver, 120 - boundary, false};
      ForwardRequest f{std::span(prompt).subspan(static_cast<size_t>(boundary)), std::span(&row, 1),
                       false, false};
      f.prompt = true;
      ForwardOutput ignored;
      d.model->forward(st, f, &ignored);
    }
    st.close_row(saver);
    const auto hit = cache.lookup(prompt, "", false);
    ASSERT_EQ(hit.tokens, boundary);
    const int slot = st.open_row();
    cache.restore(hit, slot);
    const RowInput row{slot, 120 - boundary, false};
    ForwardRequest f{std::span(prompt).subspan(static_cast<size_t>(boundary)), std::span(&row, 1),
                     false, false};
    f.prompt = true;
    ForwardOutput got;
    d.model->forward(st, f, &got);
    ASSERT_EQ(got.logits.size(), want.logits.size());
    EXPECT_EQ(
        0, std::memcmp(got.logits.data(), want.logits.data(), want.logits.size() * sizeof(float)))
        << "boundary " << boundary;
  }
}

TEST(PrefixCache, EvictsLeastRecentlyUsedUnderTheBudget) {
  auto& d = demo();
  Qwen35State st(d.model->config());
  const size_t block = Qwen35State::block_bytes(d.model->config());
  const size_t linear = sizeof(float) * static_cast<size_t>(st.linear_state_floats());
  const auto prompt = sample_tokens(64);
  // Room for two snapshots and four blocks: the 64-token entry (4 blocks, the first 3 shared with
  // the 48-token one, the first 2 with the 32-token one) evicts the oldest entry only.
  PrefixCache cache(st, 2 * linear + 4 * block, block);
  // One row saves three boundaries, as a prompt's prefill does chunk after chunk.
  const int slot0 = prefilled_row(st, first(prompt, 32));
  for (size_t n : {32, 48, 64}) {
    if (n > 32) {
      const RowInput row{slot0, 16, false};
      ForwardRequest f{std::span(prompt).subspan(n - 16, 16), std::span(&row, 1), false, false};
      f.prompt = true;
      ForwardOutput out;
      d.model->forward(st, f, &out);
    }
    cache.insert(first(prompt, n), slot0, nullptr);
  }
  st.close_row(slot0);
  EXPECT_EQ(cache.boundaries(), (std::vector<int64_t>{48, 64}));
  EXPECT_EQ(cache.stats().evictions, 1);
  EXPECT_LE(cache.stats().bytes, cache.stats().max_bytes);
  EXPECT_EQ(cache.stats().kv_blocks, 4);
  // An entry alone larger than the budget is not saved and evicts nothing.
  PrefixCache tiny(st, linear, block);
  const int slot = prefilled_row(st, first(prompt, 32));
  EXPECT_FALSE(tiny.insert(first(prompt, 32), slot, nullptr));
  EXPECT_EQ(tiny.stats().entries, 0);
  st.close_row(slot);
}

TEST(PrefixCache, ReusedEntriesOutliveOneOffsUnderPressure) {
  auto& d = demo();
  Qwen35State st(d.model->config());
  const size_t block = Qwen35State::block_bytes(d.model->config());
  const size_t linear = sizeof(float) * static_cast<size_t>(st.linear_state_floats());
  const auto text = sample_tokens(200);
  // Room for two 32-token entries of separate rows (2 blocks each), not three.
  PrefixCache cache(st, 2 * linear + 4 * block, block);
  auto save = [&](size_t from) {
    const std::vector<int32_t> p(text.begin() + static_cast<std::ptrdiff_t>(from),
                                 text.begin() + static_cast<std::ptrdiff_t>(from + 32));
    const int slot = prefilled_row(st, p);
    EXPECT_TRUE(cache.insert(p, slot, nullptr));
    st.close_row(slot);
    return p;
  };
  const auto shared = save(0);
  // A request reuses the first entry: it now outranks entries nobody reused, however recent.
  std::vector<int32_t> longer = shared;
  longer.push_back(5);
  const auto hit = cache.lookup(longer, "", false);
  ASSERT_EQ(hit.tokens, 32);
  const int slot = st.open_row();
  cache.restore(hit, slot);
  st.close_row(slot);
  save(50);
  const auto third = save(100);  // evicts the one-off at 50, not the older reused entry
  EXPECT_EQ(cache.stats().evictions, 1);
  EXPECT_EQ(cache.lookup(longer, "", false).tokens, 32);
  std::vector<int32_t> third_longer = third;
  third_longer.push_back(5);
  EXPECT_EQ(cache.lookup(third_longer, "", false).tokens, 32);
}

TEST(PrefixCache, SupersededAncestorsGoBeforeOtherOneOffs) {
  auto& d = demo();
  Qwen35State st(d.model->config());
  const size_t block = Qwen35State::block_bytes(d.model->config());
  const size_t linear = sizeof(float) * static_cast<size_t>(st.linear_state_floats());
  const auto text = sample_tokens(300);
  auto part = [&](size_t from, size_t n) {
    return std::vector<int32_t>(text.begin() + static_cast<std::ptrdiff_t>(from),
                                text.begin() + static_cast<std::ptrdiff_t>(from + n));
  };
  // Room for three snapshots and plenty of blocks.
  PrefixCache cache(st, 3 * linear + 16 * block, block);
  auto save = [&](const std::vector<int32_t>& p) {
    const int slot = prefilled_row(st, p);
    EXPECT_TRUE(cache.insert(p, slot, nullptr));
    st.close_row(slot);
  };
  const auto other = part(200, 32);
  save(other);          // the oldest, on its own
  save(part(0, 32));    // an ancestor ...
  save(part(0, 48));    // ... that this one supersedes
  save(part(100, 32));  // needs room: the superseded ancestor goes, not the older entry
  EXPECT_EQ(cache.stats().evictions, 1);
  EXPECT_EQ(cache.boundaries(), (std::vector<int64_t>{32, 32, 48}));
  auto extended = [](std::vector<int32_t> p) {
    p.push_back(5);
    return p;
  };
  EXPECT_EQ(cache.lookup(extended(other), "", false).tokens, 32);
  EXPECT_EQ(cache.lookup(extended(part(0, 48)), "", false).tokens, 48);
  EXPECT_EQ(cache.lookup(extended(part(0, 40)), "", false).tokens, 0);
  // Nothing is superseded now: plain LRU among one-offs (the lookups just used the other two).
  save(part(150, 32));
  EXPECT_EQ(cache.stats().evictions, 2);
  EXPECT_EQ(cache.lookup(extended(other), "", false).tokens, 32);
  EXPECT_EQ(cache.lookup(extended(part(100, 32)), "", false).tokens, 0);
}

// --- The engine with the cache: exactness --------------------------------------------------------

struct CacheCase {
  const char* drafter;
  float temperature;
};

class CachedPrefixes : public ::testing::TestWithParam<CacheCase> {};

// A request after another with the same leading tokens (a longer prompt; the next turn of a chat:
// the previous prompt, its answer and a new message) reuses the saved prefix and gets exactly the
// tokens of a cold engine, and, where the drafter's checkpoint is the one a prefill gives, its
// speculation statistics too.
TEST_P(CachedPrefixes, HitEqualsColdEngineTokensAndAcceptance) {
  const CacheCase c = GetParam();
  const spec::DraftProvider* drafter = drafter_named(c.drafter);
  const bool settled = std::string(c.drafter).ends_with("_settled");
  const auto text = sample_tokens(560);
  BatchEngine cached(*demo().model, drafter, "demo-target", options(size_t{1} << 30, settled));

  const GenerateRequest first_turn = request(first(text, 300), c.temperature, 5, 12);
  std::vector<int32_t> answer;
  const RequestOutcome o1 = serve(cached, first_turn, &answer);
  EXPECT_EQ(o1.cached_tokens, 0);
  // Boundaries: each 64-token chunk, and on the CPU the prompt's end and the finished turn (the
  // prompt and the answer tokens the target processed: all but the last, still pending).
  EXPECT_EQ(cached.counters().prefix_entries, 6);
  const int64_t turn_end = 300 + static_cast<int64_t>(answer.size()) - 1;

  std::vector<int32_t> next_prompt = first_turn.prompt;
  next_prompt.insert(next_prompt.end(), answer.begin(), answer.end());
  next_prompt.insert(next_prompt.end(), text.begin() + 300, text.begin() + 380);
  const std::vector<GenerateRequest> later = {
      request(next_prompt, c.temperature, 6, 16),        // the next turn
      request(first(text, 560), c.temperature, 7, 16),   // a longer prompt: the first's end
      request(first(text, 200), c.temperature, 8, 10)};  // a shorter one: a grid boundary
  const std::vector<int64_t> reused = {turn_end, 300, 192};
  for (size_t i = 0; i < later.size(); ++i) {
    std::vector<int32_t> hot, cold;
    const RequestOutcome oh = serve(cached, later[i], &hot);
    BatchEngine fresh(*demo().model, drafter, "demo-target", options(0, settled));
    const RequestOutcome oc = serve(fresh, later[i], &cold);
    EXPECT_EQ(oh.cached_tokens, reused[i]) << i;
    EXPECT_EQ(oc.cached_tokens, 0);
    EXPECT_EQ(hot, cold) << c.drafter << " request " << i;
    // The drafter resumes from its checkpoint at the boundary. At a prefill boundary that is the
    // state a cold prefill reaches, so it drafts exactly as on the cold engine. At a turn's end
    // MTP holds the rows it kept while decoding (computed from its own draft chain, not from the
    // target's hiddens a prefill feeds it): the state of the same conversation uninterrupted,
    // which may draft differently from a cold prefill of the same tokens.
    if (i == 0 && std::string(c.drafter).starts_with("mtp")) continue;
    EXPECT_EQ(oh.speculation.accepted_by_position, oc.speculation.accepted_by_position) << i;
    EXPECT_EQ(oh.speculation.drafted_by_position, oc.speculation.drafted_by_position) << i;
    EXPECT_EQ(oh.speculation.rounds, oc.speculation.rounds) << i;
  }
  const EngineCounters k = cached.counters();
  EXPECT_EQ(k.prefix_hits, 3);
  EXPECT_EQ(k.prefix_misses, 1);
  EXPECT_EQ(k.prefix_tokens_reused, turn_end + 300 + 192);
  EXPECT_GT(k.prefix_bytes, 0);
  // Blocks are held by the cache only; the rows gave theirs back.
  EXPECT_EQ(k.kv_blocks_used, k.prefix_kv_blocks);
  if (settled) {
    EXPECT_GT(k.settled_rounds, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Engine, CachedPrefixes,
                         ::testing::Values(CacheCase{"none", 0.0f}, CacheCase{"none", 0.9f},
                                           CacheCase{"mtp", 0.0f}, CacheCase{"mtp", 0.9f},
                                           CacheCase{"mtp_settled", 0.0f},
                                           CacheCase{"mtp_settled", 0.9f}, CacheCase{"ngram", 0.0f},
                                           CacheCase{"ngram", 0.9f},
                                           CacheCase{"ngram_settled", 0.0f},
                                           CacheCase{"ngram_settled", 0.9f}),
                         [](const auto& info) {
                           return std::string(info.param.drafter) +
                                  (info.param.temperature > 0 ? "_sampled" : "_greedy");
                         });

// Concurrent requests sharing a long system prompt, joining while the first still prefills or
// decodes: each equals its cold result; the later ones reuse the prefix.
TEST(CachedPrefixes, SharedSystemPromptAcrossConcurrentRequests) {
  auto& d = demo();
  const auto text = sample_tokens(400);
  const std::vector<int32_t> system = first(text, 260);
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 5; ++i) {
    std::vector<int32_t> p = system;
    const auto user = d.tok->encode(test::kDemoPrompts[static_cast<size_t>(i) % 3]);
    p.insert(p.end(), user.begin(), user.end());
    p.push_back(static_cast<int32_t>(100 + i));
    reqs.push_back(request(p, i % 2 ? 0.8f : 0.0f, 20 + static_cast<uint64_t>(i), 10));
  }
  BatchEngine engine(*d.model, d.mtp.get(), "demo-target", options(size_t{1} << 30));
  std::vector<std::shared_ptr<Recorder>> sinks;
  size_t next = 0;
  for (int steps = 0; steps < 2000; ++steps) {
    if (next < reqs.size() && steps % 3 == 0) {
      sinks.push_back(std::make_shared<Recorder>());
      EngineRequest er;
      er.gen = reqs[next++];
      ASSERT_EQ(engine.submit(er, sinks.back()), BatchEngine::Submit::Queued);
    }
    if (!engine.step() && next == reqs.size()) break;
  }
  int64_t reused = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(sinks[i]->outcome.has_value());
    BatchEngine fresh(*d.model, d.mtp.get(), "demo-target", options(0));
    std::vector<int32_t> cold;
    serve(fresh, reqs[i], &cold);
    EXPECT_EQ(sinks[i]->tokens, cold) << i;
    reused += sinks[i]->outcome->cached_tokens;
  }
  // The first request saved the system prompt's 256-token boundary before the others joined.
  EXPECT_GE(reused, 256);
  EXPECT_EQ(engine.counters().prefix_tokens_reused, reused);
}

// A small fixed pool: blocks only the cache holds are given back when a request needs them, and a
// tiny byte budget keeps evicting; every request still equals its cold result.
TEST(CachedPrefixes, FixedPoolAndTinyBudgetEvictAndStayExact) {
  auto& d = demo();
  const auto text = sample_tokens(520);
  EngineOptions o = options(0);
  const size_t block = Qwen35State::block_bytes(d.model->config());
  o.kv_blocks = Qwen35State::blocks_for(520 + 8 + 4) + 2;  // one long request at a time
  o.prefix_cache_bytes = 12 * block + 4 * Qwen35State::row_bytes(d.model->config(), 1);
  BatchEngine engine(*d.model, d.ngram.get(), "demo-target", o);
  const std::vector<GenerateRequest> reqs = {
      request(first(text, 100), 0.0f, 1, 8), request(first(text, 130), 0.7f, 2, 8),
      request(first(text, 520), 0.0f, 3, 8), request(first(text, 140), 0.0f, 4, 8)};
  for (const auto& r : reqs) {
    std::vector<int32_t> hot, cold;
    serve(engine, r, &hot);
    BatchEngine fresh(*d.model, d.ngram.get(), "demo-target", options(0));
    serve(fresh, r, &cold);
    EXPECT_EQ(hot, cold);
    const EngineCounters k = engine.counters();
    EXPECT_LE(k.prefix_bytes, k.prefix_max_bytes);
  }
  EXPECT_GT(engine.counters().prefix_evictions, 0);
  EXPECT_GT(engine.counters().prefix_hits, 0);
}

}  // namespace
}  // namespace tandem
