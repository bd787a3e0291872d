// Backend contexts (backend/context.h) on the CPU: which context is current, how scopes nest and
// unwind, which context a model being built takes, and two models holding their own contexts
// decoding interleaved exactly as each alone. The GPU side (streams, ordering, scratch per
// context, two models on two threads) is tests/cuda/test_cuda_context.cpp.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "demo_model.h"
#include "tandem/backend/context.h"
#include "tandem/backend/ops.h"
#include "tandem/core/error.h"
#include "tandem/core/sampler.h"
#include "tandem/model/qwen3_5.h"

namespace tandem {
namespace {

TEST(Context, TheInnermostScopeIsCurrentAndLeavingRestoresTheOuter) {
  ASSERT_EQ(ops::backend(), ops::Backend::Cpu);
  ops::Context& fallback = ops::default_context(ops::Backend::Cpu);
  EXPECT_EQ(&ops::current_context(), &fallback);
  const auto a = ops::Context::create(), b = ops::Context::create();
  EXPECT_NE(a->id(), b->id());
  EXPECT_EQ(a->backend(), ops::Backend::Cpu);
  EXPECT_EQ(a->native(), nullptr);
  {
    const ops::ContextScope sa(a);
    EXPECT_EQ(&ops::current_context(), a.get());
    {
      const ops::ContextScope sb(b);
      EXPECT_EQ(&ops::current_context(), b.get());
      const ops::ContextScope again(b);  // re-entering the current context is allowed
      EXPECT_EQ(&ops::current_context(), b.get());
    }
    EXPECT_EQ(&ops::current_context(), a.get());
  }
  EXPECT_EQ(&ops::current_context(), &fallback);
}

TEST(Context, AnExceptionLeavesTheScopesItCrosses) {
  const auto a = ops::Context::create();
  try {
    const ops::ContextScope s(a);
    throw std::runtime_error("inside");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(&ops::current_context(), &ops::default_context(ops::Backend::Cpu));
}

TEST(Context, AModelBuiltInsideAScopeSharesItsContextAndOneBuiltOutsideGetsItsOwn) {
  const auto outer = ops::Context::create();
  {
    const ops::ContextScope s(outer);
    EXPECT_EQ(ops::Context::for_new_model().get(), outer.get());
  }
  const auto fresh = ops::Context::for_new_model();
  EXPECT_NE(fresh.get(), outer.get());
  EXPECT_NE(fresh.get(), &ops::default_context(ops::Backend::Cpu));
  // Ids are never reused.
  EXPECT_GT(ops::Context::create()->id(), fresh->id());
}

TEST(Context, ACpuContextHasOneDevice) {
  try {
    (void)ops::Context::create(1);
    FAIL() << "device 1 of the CPU backend was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("device 1"), std::string::npos) << e.what();
  }
}

// Greedy tokens after `prompt`, with every forward's logits.
std::vector<float> decode(const Qwen35Model& m, Qwen35State& st, int slot,
                          const std::vector<int32_t>& prompt, int steps,
                          std::vector<int32_t>* tokens) {
  const int64_t V = m.config().vocab_size;
  std::vector<float> all;
  ForwardOutput out;
  const RowInput row{slot, static_cast<int64_t>(prompt.size())};
  m.forward(st, {prompt, {&row, 1}, false, false}, &out);
  all = out.logits;
  for (int i = 0; i < steps; ++i) {
    const int32_t next =
        argmax(std::span<const float>(out.logits.data() + out.logits.size() - V, V));
    tokens->push_back(next);
    const std::vector<int32_t> tok = {next};
    const RowInput r{slot, 1};
    m.forward(st, {tok, {&r, 1}, false, false}, &out);
    all.insert(all.end(), out.logits.begin(), out.logits.end());
  }
  return all;
}

TEST(Context, TwoModelsWithTheirOwnContextsDecodeInterleavedAsAlone) {
  const auto a = Qwen35Model::load(test::kDemoDir);
  const auto b = Qwen35Model::load(test::kDemoDir);
  ASSERT_NE(&a->context(), &b->context()) << "models loaded outside a scope share a context";
  const std::vector<int32_t> pa = {970, 11, 1879, 0, 576}, pb = {3, 17, 42, 5, 9, 11, 2};
  constexpr int kSteps = 6;
  std::vector<int32_t> ta, tb;
  std::vector<float> la, lb;
  {
    Qwen35State sa(a->config()), sb(b->config());
    la = decode(*a, sa, sa.open_row(), pa, kSteps, &ta);
    lb = decode(*b, sb, sb.open_row(), pb, kSteps, &tb);
  }
  // Interleaved: model a's prompt, then b's, then one step each in turn.
  Qwen35State sa(a->config()), sb(b->config());
  const int ra = sa.open_row(), rb = sb.open_row();
  ForwardOutput oa, ob;
  const RowInput pra{ra, static_cast<int64_t>(pa.size())}, prb{rb, static_cast<int64_t>(pb.size())};
  a->forward(sa, {pa, {&pra, 1}, false, false}, &oa);
  b->forward(sb, {pb, {&prb, 1}, false, false}, &ob);
  const int64_t V = a->config().vocab_size;
  std::vector<float> ia = oa.logits, ib = ob.logits;
  for (int i = 0; i < kSteps; ++i) {
    const std::vector<int32_t> na = {ta[static_cast<size_t>(i)]}, nb = {tb[static_cast<size_t>(i)]};
    const RowInput sra{ra, 1}, srb{rb, 1};
    a->forward(sa, {na, {&sra, 1}, false, false}, &oa);
    b->forward(sb, {nb, {&srb, 1}, false, false}, &ob);
    ia.insert(ia.end(), oa.logits.begin(), oa.logits.end());
    ib.insert(ib.end(), ob.logits.begin(), ob.logits.end());
  }
  ASSERT_EQ(ia.size(), la.size());
  ASSERT_EQ(ib.size(), lb.size());
  EXPECT_EQ(ia, la) << "model a's logits changed when interleaved with model b";
  EXPECT_EQ(ib, lb) << "model b's logits changed when interleaved with model a";
  EXPECT_GT(static_cast<int64_t>(ia.size()), V);
}

}  // namespace
}  // namespace tandem
