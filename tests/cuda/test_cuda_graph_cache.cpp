// GraphCache: graphs are named by their whole key (never by a hash alone) and, when the table is
// full, only the least recently run graph is dropped.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "tandem/backend/graph_cache.h"
#include "tandem/backend/ops.h"

namespace tandem {
namespace {

using testing::CudaTest;
using testing::DeviceBuffer;
using testing::ScopedBackend;

using CudaGraphCache = CudaTest;

// Adds `amount` to x[0] (device) through the op layer, so a replayed graph does it again.
void add_to(float* x, const float* amount) {
  ops::add_inplace(x, amount, 1);
}

TEST_F(CudaGraphCache, EveryKeyRunsItsOwnWorkAndTheLeastRecentGoesFirst) {
  ScopedBackend cuda(ops::Backend::Cuda);
  ASSERT_TRUE(ops::graphs_enabled());
  DeviceBuffer<float> x(std::vector<float>{0.0f});
  const DeviceBuffer<float> one(std::vector<float>{1.0f}), ten(std::vector<float>{10.0f});
  GraphCache cache;
  // Two keys that agree on every word but the last: each replays its own body.
  const GraphKey a = GraphKey().add(uint64_t{7}).add(uint64_t{1});
  const GraphKey b = GraphKey().add(uint64_t{7}).add(uint64_t{2});
  EXPECT_FALSE(a == b);
  for (int i = 0; i < 3; ++i) {
    cache.run(a, [&] { add_to(x.get(), one.get()); });
    cache.run(b, [&] { add_to(x.get(), ten.get()); });
  }
  EXPECT_EQ(x.download()[0], 33.0f);
  EXPECT_EQ(cache.captures(), 2);  // each key captured on its second run
  EXPECT_EQ(cache.size(), 2u);

  // Fill the table: a stays recent, so the victim is b (the least recently run), not a.
  cache.run(a, [&] { add_to(x.get(), one.get()); });
  for (uint64_t k = 0; cache.size() < GraphCache::kMaxGraphs; ++k)
    cache.run(GraphKey().add(uint64_t{1000} + k), [] {});
  EXPECT_EQ(cache.evictions(), 0);
  const int64_t evicted = GraphCache::evicted_graphs();  // by any cache on this thread
  cache.run(GraphKey().add(uint64_t{5000}), [] {});
  EXPECT_EQ(cache.evictions(), 1);
  EXPECT_EQ(GraphCache::evicted_graphs(), evicted + 1);
  EXPECT_EQ(cache.size(), GraphCache::kMaxGraphs);
  const int64_t captured = cache.captures();
  cache.run(a, [&] { add_to(x.get(), one.get()); });  // still captured: a replay
  EXPECT_EQ(cache.captures(), captured);
  cache.run(b, [&] { add_to(x.get(), ten.get()); });  // dropped: runs directly, seen once
  EXPECT_EQ(cache.captures(), captured);
  EXPECT_EQ(x.download()[0], 33.0f + 1.0f + 1.0f + 10.0f);
}

// The depth policy leaves rounds that ran a graph cold untimed (GraphCache::cold_runs): a key's
// first run and its capture count, replays do not, whichever cache ran them.
TEST_F(CudaGraphCache, ColdRunsCountFirstRunsAndCapturesOnly) {
  ScopedBackend cuda(ops::Backend::Cuda);
  DeviceBuffer<float> x(std::vector<float>{0.0f});
  const DeviceBuffer<float> one(std::vector<float>{1.0f});
  GraphCache first, second;
  const GraphKey a = GraphKey().add(uint64_t{41});
  const int64_t cold = GraphCache::cold_runs();
  first.run(a, [&] { add_to(x.get(), one.get()); });  // eager
  EXPECT_EQ(GraphCache::cold_runs(), cold + 1);
  first.run(a, [&] { add_to(x.get(), one.get()); });  // captured
  EXPECT_EQ(GraphCache::cold_runs(), cold + 2);
  for (int i = 0; i < 5; ++i) first.run(a, [&] { add_to(x.get(), one.get()); });
  EXPECT_EQ(GraphCache::cold_runs(), cold + 2);        // replays
  second.run(a, [&] { add_to(x.get(), one.get()); });  // the same key, another cache: cold
  EXPECT_EQ(GraphCache::cold_runs(), cold + 3);
  EXPECT_EQ(x.download()[0], 8.0f);
}

}  // namespace
}  // namespace tandem
