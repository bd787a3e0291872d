// GLM-5 (glm_moe_dsa) against transformers: tiny random checkpoints, bf16 and fp8 with 16 x 16
// block scales, and one whose second layer reuses the first's DSA choice (tests/fixtures/glm5_*,
// made by tools/make_glm5_fixtures.py on the GPU machine),
// with prompts longer than index_topk so the DSA indexer drops positions. Checked: logits of one
// prompt forward (expanded MLA) and of token-by-token decoding (absorbed MLA) within 1e-3 of the
// logit scale, every sparse layer's experts and every layer's DSA choice equal to transformers'
// where the choice has a margin, and greedy continuations equal at tie-free steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "fixture_reference.h"
#include "tandem/core/dtype.h"
#include "tandem/io/safetensors.h"
#include "tandem/model/glm5.h"

namespace tandem {
namespace {

using Reference = testing::FixtureReference;

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

class Glm5Parity : public ::testing::TestWithParam<std::string> {};

TEST_P(Glm5Parity, LogitsRoutingIndexAndGreedyMatchTransformers) {
  const std::string dir = std::string(TANDEM_FIXTURES_DIR) + "/" + GetParam();
  const auto model = Glm5Model::load(dir);
  const Reference ref{SafetensorsFile::open(dir + "/reference.safetensors")};
  const Glm5Config& c = model->config();
  const int64_t V = c.vocab_size, K = c.num_experts_per_tok, topk = c.index_topk;
  const int64_t layers = c.num_hidden_layers;
  const auto sparse =
      static_cast<int64_t>(std::count(c.sparse_layers.begin(), c.sparse_layers.end(), true));
  int64_t routed = 0, indexed = 0, sparse_queries = 0, tie_free = 0;
  for (int i = 0; i < 2; ++i) {
    const std::string s = std::to_string(i);
    const auto tokens = ref.ids("tokens_" + s);
    const auto want = ref.floats("logits_" + s);
    const auto n = static_cast<int64_t>(tokens.size());
    ASSERT_GT(n, topk) << "the prompts must make the indexer drop positions";
    Glm5State st(c, 2);
    const RowInput row{st.open_row(), n, false};
    ForwardRequest req;
    req.tokens = tokens;
    req.rows = {&row, 1};
    req.all_logits = true;
    req.prompt = true;
    req.want_routing = true;
    req.want_index_selection = true;
    ForwardOutput out;
    model->forward(st, req, &out);
    ASSERT_EQ(out.logits.size(), want.size());
    const double scale = max_abs(want);
    double worst = 0;
    for (size_t k = 0; k < want.size(); ++k)
      worst = std::max(worst, std::fabs(out.logits[k] - want[k]) / scale);
    EXPECT_LT(worst, 1e-3) << GetParam() << " prompt " << i << ": logit scale " << scale;
    RecordProperty("max_rel_logit_error_" + s, std::to_string(worst));

    // Routing: the same experts (as sets: transformers' top-k is unsorted) where the k-th and
    // (k+1)-th biased choices are apart.
    const auto want_routing = ref.ids("routing_" + s);
    const auto margin = ref.floats("routing_margin_" + s);
    routed += testing::expect_same_routing(out.routing, want_routing, margin, sparse, n, K, 1e-4f,
                                           GetParam() + " prompt " + s);

    // The DSA choice: the same set of earlier positions (transformers pads a query with fewer
    // than index_topk positions with later ones, which its causal mask removes).
    const auto want_index = ref.ints("index_" + s);
    ASSERT_EQ(want_index.size(), static_cast<size_t>(layers * n * topk));
    ASSERT_EQ(out.index_selection.size(), want_index.size());
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t t = 0; t < n; ++t) {
        std::vector<int64_t> got, exp;
        for (int64_t j = 0; j < topk; ++j) {
          const size_t at = static_cast<size_t>((l * n + t) * topk + j);
          if (out.index_selection[at] >= 0) got.push_back(out.index_selection[at]);
          if (want_index[at] >= 0 && want_index[at] <= t) exp.push_back(want_index[at]);
        }
        std::sort(got.begin(), got.end());
        std::sort(exp.begin(), exp.end());
        EXPECT_EQ(got, exp) << "prompt " << i << " layer " << l << " query " << t;
        ++indexed;
        if (t + 1 > topk) ++sparse_queries;
      }

    // Decoding token by token (the absorbed form) stays within the same tolerance.
    const int slot = st.open_row();
    double worst_decode = 0;
    for (int64_t t = 0; t < n; ++t) {
      const RowInput one{slot, 1, false};
      ForwardRequest step;
      step.tokens = {tokens.data() + t, 1};
      step.rows = {&one, 1};
      ForwardOutput o;
      model->forward(st, step, &o);
      for (int64_t v = 0; v < V; ++v)
        worst_decode = std::max(worst_decode, std::fabs(o.logits[static_cast<size_t>(v)] -
                                                        want[static_cast<size_t>(t * V + v)]) /
                                                  scale);
    }
    EXPECT_LT(worst_decode, 1e-3) << GetParam() << " prompt " << i << " decoded";

    // Greedy: the fixture's continuation, where its top two logits are apart.
    const auto prompt = ref.ids("prompt_" + s);
    const auto greedy = ref.ids("greedy_" + s);
    const auto gaps = ref.floats("greedy_gap_" + s);
    Glm5State gs(c, 1);
    const int g = gs.open_row();
    std::vector<int32_t> next = prompt;
    bool first = true;
    for (size_t j = 0; j < greedy.size(); ++j) {
      const RowInput r{g, static_cast<int64_t>(next.size()), false};
      ForwardRequest gr;
      gr.tokens = next;
      gr.rows = {&r, 1};
      gr.prompt = first;
      gr.want_argmax = true;
      ForwardOutput o;
      model->forward(gs, gr, &o);
      first = false;
      if (gaps[j] <= 1e-2 * scale) break;  // a near-tie may go either way
      EXPECT_EQ(o.argmax[0], greedy[j]) << "prompt " << i << " step " << j;
      ++tie_free;
      next = {greedy[j]};
    }
  }
  EXPECT_GT(routed, 0);
  EXPECT_GT(sparse_queries, 0);
  EXPECT_GT(indexed, 0);
  EXPECT_GT(tie_free, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Glm5Parity,
                         ::testing::Values("glm5_bf16", "glm5_fp8", "glm5_shared_index"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tandem
