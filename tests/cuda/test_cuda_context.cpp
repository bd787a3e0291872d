// Backend contexts on the GPU (backend/context.h): each holds its own stream and scratch, ops run
// on the current one, a switch orders the streams, graphs are captured per context, and two
// models with their own contexts decode at the same time on two threads exactly as each alone.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "demo_model.h"
#include "tandem/backend/context.h"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/graph_cache.h"
#include "tandem/backend/memory_info.h"
#include "tandem/backend/ops.h"
#include "tandem/model/qwen3_5.h"

namespace tandem {
namespace {

using testing::CudaTest;
using testing::DeviceBuffer;
using testing::ScopedBackend;

class CudaContext : public CudaTest {};

TEST_F(CudaContext, OpsRunOnTheCurrentContextsStream) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const auto a = ops::Context::create(), b = ops::Context::create();
  EXPECT_NE(a->id(), b->id());
  void* const outside = cuda::stream();
  EXPECT_EQ(&ops::current_context(), &ops::default_context(ops::Backend::Cuda));
  void *in_a = nullptr, *in_b = nullptr, *back_in_a = nullptr;
  {
    const ops::ContextScope sa(*a);
    in_a = cuda::stream();
    EXPECT_EQ(&ops::current_context(), a.get());
    {
      const ops::ContextScope sb(*b);
      in_b = cuda::stream();
      EXPECT_EQ(&ops::current_context(), b.get());
      // A model built here joins the open scope's context.
      EXPECT_EQ(ops::Context::for_new_model().get(), b.get());
    }
    back_in_a = cuda::stream();
  }
  EXPECT_NE(in_a, outside);
  EXPECT_NE(in_b, outside);
  EXPECT_NE(in_a, in_b);
  EXPECT_EQ(back_in_a, in_a) << "leaving a nested scope must restore the outer context";
  EXPECT_EQ(cuda::stream(), outside) << "leaving every scope must restore the default context";
  EXPECT_NE(ops::Context::for_new_model().get(), a.get()) << "outside a scope: a new context";
  EXPECT_THROW(ops::Context::create(1 << 20), Error);
}

// Work queued in one context and read in another right after the switch: the reading stream
// waits for the writing one. Without the ordering the copy would start while the fills (~0.1 s
// of queued work) still run and read an earlier fill's values.
TEST_F(CudaContext, ASwitchOrdersTheStreams) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const auto writer = ops::Context::create(), reader = ops::Context::create();
  constexpr int64_t n = int64_t(1) << 26;  // 256 MiB of floats
  DeviceBuffer<float> buf(static_cast<size_t>(n));
  std::vector<float> head(4096), want(4096);
  {
    const ops::ContextScope w(*writer);
    cuda::fill_random_f32(buf.get(), 4096, 99, 0.0f, 1.0f);
    cuda::copy_to_host(want.data(), buf.get(), sizeof(float) * want.size());
    cuda::fill_zero(buf.get(), sizeof(float) * n);
    cuda::synchronize();
    for (int r = 0; r < 40; ++r) cuda::fill_random_f32(buf.get(), n, 1000 + r, 0.0f, 1.0f);
    cuda::fill_random_f32(buf.get(), 4096, 99, 0.0f, 1.0f);
  }
  {
    const ops::ContextScope r(*reader);
    cuda::copy_to_host(head.data(), buf.get(), sizeof(float) * head.size());
  }
  EXPECT_EQ(head, want) << "the reading context did not wait for the writing context's work";
}

// One graph key run under two contexts: each captures its own graph (a graph bakes in its
// context's scratch and stream), and each replay gives the op's result.
TEST_F(CudaContext, GraphsAreCapturedPerContext) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const auto a = ops::Context::create(), b = ops::Context::create();
  constexpr int64_t rows = 3, V = 50000;
  std::mt19937 rng(5);
  std::vector<float> logits = testing::uniform(rows * V, rng, -4.0f, 4.0f);
  logits[0 * V + 777] = 9.0f;
  logits[1 * V + 12] = 9.0f;
  logits[2 * V + 49999] = 9.0f;
  const DeviceBuffer<float> d_logits(logits);
  GraphCache graphs;
  GraphKey key;
  key.add(uint64_t{42});
  for (const auto& ctx : {a, b}) {
    const ops::ContextScope s(*ctx);
    DeviceBuffer<int32_t> out(rows);
    GraphKey k = key;
    k.add(out.get());
    for (int run = 0; run < 3; ++run) {
      cuda::fill_zero(out.get(), out.bytes());
      graphs.run(k, [&] { cuda::argmax_rows(d_logits.get(), rows, V, out.get()); });
      EXPECT_EQ(out.download(), (std::vector<int32_t>{777, 12, 49999})) << "run " << run;
    }
  }
  EXPECT_EQ(graphs.captures(), 2) << "each context captures the key once";
}

// A context's scratch (here a prompt-prefill product's: cuBLASLt's 32 MiB workspace and the
// bf16 input rows) is freed with it.
TEST_F(CudaContext, ADestroyedContextFreesItsScratch) {
  ScopedBackend cuda(ops::Backend::Cuda);
  constexpr int64_t N = 1024, K = 1024, m = 4096;
  DeviceBuffer<uint16_t> w(static_cast<size_t>(N * K));
  DeviceBuffer<float> x(static_cast<size_t>(m * K)), y(static_cast<size_t>(m * N));
  cuda::fill_random_bf16(w.get(), N * K, 1, 0.05f);
  cuda::fill_random_f32(x.get(), m * K, 2, 0.0f, 1.0f);
  cuda::synchronize();
  const uint64_t before = available_memory_bytes();
  uint64_t during = 0;
  {
    const auto ctx = ops::Context::create();
    const ops::ContextScope s(*ctx);
    cuda::set_prefill(true, 256);
    cuda::linear(x.get(), m, ops::WeightRef{DType::BF16, w.get(), N, K, {}}, y.get());
    cuda::set_prefill(false);
    cuda::synchronize();
    during = available_memory_bytes();
  }
  const uint64_t after = available_memory_bytes();
  ASSERT_LE(during + (uint64_t(32) << 20), before) << "the product allocated no scratch";
  EXPECT_GE(after + (uint64_t(2) << 20), before)
      << "a destroyed context left " << ((before - after) >> 20) << " MiB allocated";
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

struct Decoded {
  std::vector<float> logits;  // prompt logits, then each step's
  std::vector<int32_t> tokens;
};

// Greedy decoding of `steps` tokens after `prompt` (logits of every forward kept).
Decoded decode(const Qwen35Model& m, const std::vector<int32_t>& prompt, int steps) {
  Decoded d;
  Qwen35State st(m.config());
  const RowInput row{st.open_row(), static_cast<int64_t>(prompt.size())};
  ForwardRequest req{prompt, {&row, 1}, false, false};
  req.prompt = true;
  ForwardOutput out;
  m.forward(st, req, &out);
  d.logits = out.logits;
  for (int i = 0; i < steps; ++i) {
    const int64_t V = m.config().vocab_size;
    const float* last = out.logits.data() + out.logits.size() - V;
    const int32_t next = argmax(std::span<const float>(last, static_cast<size_t>(V)));
    d.tokens.push_back(next);
    const std::vector<int32_t> tok = {next};
    const RowInput r{row.slot, 1};
    m.forward(st, {tok, {&r, 1}, false, false}, &out);
    d.logits.insert(d.logits.end(), out.logits.begin(), out.logits.end());
  }
  return d;
}

// A dense model and a mixture of experts, each with its own context, decode at the same time on
// two threads: every logit is bitwise what each model gives decoding alone. With any op's
// scratch, plan or counter shared between them, the two streams would overwrite each other's.
TEST_F(CudaContext, TwoModelsDecodeConcurrentlyAsAlone) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const auto dense = Qwen35Model::load(test::kDemoDir);
  const auto moe = Qwen35Model::load(std::string(TANDEM_FIXTURES_DIR) + "/qwen35_moe_per_expert");
  ASSERT_NE(dense->context().id(), moe->context().id());
  const std::vector<int32_t> p_dense = {970, 11, 1879, 0, 576, 374, 264, 1273},
                             p_moe = {3, 17, 42, 5, 9, 11, 2, 8, 30};
  constexpr int kSteps = 24;
  const Decoded alone_dense = decode(*dense, p_dense, kSteps);
  const Decoded alone_moe = decode(*moe, p_moe, kSteps);
  for (int round = 0; round < 3; ++round) {
    Decoded both_dense, both_moe;
    std::string err_dense, err_moe;
    std::thread t1([&] {
      try {
        both_dense = decode(*dense, p_dense, kSteps);
      } catch (const std::exception& e) {
        err_dense = e.what();
      }
    });
    std::thread t2([&] {
      try {
        both_moe = decode(*moe, p_moe, kSteps);
      } catch (const std::exception& e) {
        err_moe = e.what();
      }
    });
    t1.join();
    t2.join();
    ASSERT_EQ(err_dense, "");
    ASSERT_EQ(err_moe, "");
    EXPECT_EQ(both_dense.tokens, alone_dense.tokens) << "round " << round;
    EXPECT_EQ(both_moe.tokens, alone_moe.tokens) << "round " << round;
    EXPECT_TRUE(same_bits(both_dense.logits, alone_dense.logits))
        << "round " << round << ": the dense model's logits changed beside the other model";
    EXPECT_TRUE(same_bits(both_moe.logits, alone_moe.logits))
        << "round " << round << ": the mixture's logits changed beside the other model";
  }
}

}  // namespace
}  // namespace tandem
