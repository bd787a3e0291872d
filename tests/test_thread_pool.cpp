// The CPU thread pool (backend/cpu/thread_pool.h): every index once, numbers independent of the
// thread count (the pool alone and every parallel CPU op), exceptions, nesting, concurrent
// callers, and that waiting threads sleep instead of spinning.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <time.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/backend/ops.h"
#include "tandem/core/dtype.h"

namespace tandem::cpu {
namespace {

using namespace std::chrono_literals;

double cpu_seconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Restores the process-wide thread count when a test ends.
struct ThreadCountGuard {
  ~ThreadCountGuard() { ops::set_thread_count(0); }
};

TEST(ThreadPool, EveryIndexOnceInContiguousChunks) {
  for (int threads : {1, 2, 3, 4, 7}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 2, 3, 5, 7, 8, 9, 27, 28, 29, 31, 64, 100, 1000, 4099, 100003}) {
      std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
      std::atomic<int> calls{0}, bad_ranges{0};
      pool.parallel_for(n, [&](int64_t b, int64_t e) {
        calls.fetch_add(1);
        if (b < 0 || b >= e || e > n) bad_ranges.fetch_add(1);
        for (int64_t i = b; i < e; ++i) seen[static_cast<size_t>(i)].fetch_add(1);
      });
      ASSERT_EQ(bad_ranges.load(), 0) << threads << " threads, n " << n;
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(seen[static_cast<size_t>(i)].load(), 1)
            << "index " << i << ", " << threads << " threads, n " << n;
      // At most kChunksPerThread chunks per thread, and none for an empty range.
      EXPECT_LE(calls.load(), std::max<int64_t>(n == 0 ? 0 : 1, std::min<int64_t>(n, threads * 4)));
    }
  }
}

TEST(ThreadPool, ChunkBoundariesDependOnlyOnRangeAndThreadCount) {
  ThreadPool pool(3);
  auto boundaries = [&] {
    std::vector<std::atomic<int64_t>> end_of(101);
    pool.parallel_for(101, [&](int64_t b, int64_t e) { end_of[static_cast<size_t>(b)] = e; });
    std::vector<int64_t> out;
    for (auto& e : end_of) out.push_back(e.load());
    return out;
  };
  const auto first = boundaries();
  for (int i = 0; i < 50; ++i) ASSERT_EQ(boundaries(), first);
}

// A per-index value computed by a long dependent chain in float: any change in which operations
// an index sees would change its bits.
float chain(int64_t i) {
  float v = static_cast<float>(i) * 0.37f + 1.0f;
  for (int k = 0; k < 200; ++k) v = std::sin(v) * 1.7f + static_cast<float>(k) * 1e-3f;
  return v;
}

TEST(ThreadPool, ResultsIndependentOfThreadCount) {
  const int64_t n = 5003;
  std::vector<float> ref(n);
  for (int64_t i = 0; i < n; ++i) ref[static_cast<size_t>(i)] = chain(i);
  for (int threads : {1, 2, 3, 5, 8}) {
    ThreadPool pool(threads);
    std::vector<float> got(n, -1.0f);
    pool.parallel_for(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) got[static_cast<size_t>(i)] = chain(i);
    });
    ASSERT_EQ(std::memcmp(got.data(), ref.data(), sizeof(float) * n), 0) << threads << " threads";
  }
}

TEST(ThreadPool, ExceptionReachesTheCallerAndThePoolStaysUsable) {
  ThreadPool pool(4);
  for (int round = 0; round < 20; ++round) {
    // One chunk throws (whichever thread runs it).
    try {
      pool.parallel_for(1000, [&](int64_t b, int64_t e) {
        if (b <= 517 && 517 < e) throw std::runtime_error("index 517");
      });
      FAIL() << "no exception";
    } catch (const std::runtime_error& err) {
      EXPECT_STREQ(err.what(), "index 517");
    }
    // Every chunk throws: exactly one exception comes back.
    EXPECT_THROW(
        pool.parallel_for(64, [](int64_t, int64_t) { throw std::logic_error("every chunk"); }),
        std::logic_error);
    std::atomic<int64_t> sum{0};
    pool.parallel_for(1000, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sum.fetch_add(i);
    });
    EXPECT_EQ(sum.load(), 999 * 1000 / 2);
  }
}

TEST(ThreadPool, ExceptionFromAWorkerThread) {
  ThreadPool pool(2, 0us);
  const auto caller = std::this_thread::get_id();
  std::atomic<bool> worker_ran{false};
  // The caller's chunks wait until a worker has claimed one, which then throws.
  EXPECT_THROW(pool.parallel_for(8,
                                 [&](int64_t, int64_t) {
                                   if (std::this_thread::get_id() != caller) {
                                     worker_ran = true;
                                     throw std::out_of_range("from a worker");
                                   }
                                   const auto give_up = std::chrono::steady_clock::now() + 10s;
                                   while (!worker_ran && std::chrono::steady_clock::now() < give_up)
                                     std::this_thread::sleep_for(100us);
                                 }),
               std::out_of_range);
  EXPECT_TRUE(worker_ran.load());
}

TEST(ThreadPool, NestedCallsRunSeriallyOnTheCallingThread) {
  ThreadPool pool(4);
  std::atomic<int> inner_calls{0}, wrong{0};
  pool.parallel_for(16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const auto me = std::this_thread::get_id();
      // Same pool and the process-wide pool: one call with the whole range, on this thread.
      pool.parallel_for(100, [&](int64_t ib, int64_t ie) {
        inner_calls.fetch_add(1);
        if (ib != 0 || ie != 100 || std::this_thread::get_id() != me) wrong.fetch_add(1);
      });
      parallel_for(100, [&](int64_t ib, int64_t ie) {
        inner_calls.fetch_add(1);
        if (ib != 0 || ie != 100 || std::this_thread::get_id() != me) wrong.fetch_add(1);
      });
    }
  });
  EXPECT_EQ(inner_calls.load(), 32);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_FALSE(ThreadPool::in_task());  // restored on the caller
}

TEST(ThreadPool, ConcurrentCallersEachGetTheirWholeRange) {
  ThreadPool pool(3);
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&, c] {
      for (int round = 0; round < 200; ++round) {
        const int64_t n = 100 + c * 37 + round;
        std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
        pool.parallel_for(n, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) seen[static_cast<size_t>(i)].fetch_add(1);
        });
        for (auto& s : seen)
          if (s.load() != 1) failures.fetch_add(1);
      }
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(ThreadPool, IdleWorkersSleep) {
  ThreadPool pool(4);
  // A burst of small jobs, as decode issues them.
  std::vector<float> out(4096);
  for (int round = 0; round < 2000; ++round)
    pool.parallel_for(4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) out[static_cast<size_t>(i)] = static_cast<float>(i + round);
    });
  // Three workers spinning for the next 200 ms would burn 600 ms of CPU; sleeping ones, ~0.
  const double cpu0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
  std::this_thread::sleep_for(200ms);
  const double idle_cpu = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - cpu0;
  EXPECT_LT(idle_cpu, 0.05) << "process CPU time while the pool was idle for 200 ms";
}

TEST(ThreadPool, CallerSleepsWhileAWorkerFinishesALongChunk) {
  ThreadPool pool(2);
  const auto caller = std::this_thread::get_id();
  std::atomic<bool> worker_started{false};
  const double cpu0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
  const auto t0 = std::chrono::steady_clock::now();
  pool.parallel_for(8, [&](int64_t, int64_t) {
    if (std::this_thread::get_id() != caller) {
      // The first chunk a worker claims takes 200 ms (without using the CPU).
      if (!worker_started.exchange(true)) std::this_thread::sleep_for(200ms);
      return;
    }
    const auto give_up = std::chrono::steady_clock::now() + 10s;
    while (!worker_started && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(100us);
  });
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double caller_cpu = cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - cpu0;
  ASSERT_TRUE(worker_started.load());
  EXPECT_GE(wall, 0.19);
  EXPECT_LT(caller_cpu, 0.05) << "the caller's CPU time while it waited " << wall << " s";
}

TEST(ThreadPool, PollingBudgetShrinksOnTimeoutsAndRecovers) {
  const auto max = std::chrono::nanoseconds(1ms);
  // A pool starts at the full budget. (Checked on one without workers: an idle worker's wait for
  // a job times out after the budget and halves it, so a two-thread pool's budget may already be
  // lower by the time the test reads it.)
  EXPECT_EQ(ThreadPool(1, max).spin_budget(), max);
  ThreadPool pool(2, max);
  // The caller's wait for a 50 ms chunk on a worker outlasts any budget: a timeout.
  const auto caller = std::this_thread::get_id();
  std::atomic<bool> worker_started{false};
  pool.parallel_for(8, [&](int64_t, int64_t) {
    if (std::this_thread::get_id() != caller) {
      if (!worker_started.exchange(true)) std::this_thread::sleep_for(50ms);
      return;
    }
    const auto give_up = std::chrono::steady_clock::now() + 10s;
    while (!worker_started && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(100us);
  });
  ASSERT_TRUE(worker_started.load());
  EXPECT_LT(pool.spin_budget(), max);
  EXPECT_GE(pool.spin_budget(), std::chrono::nanoseconds(ThreadPool::kMinSpin));
  // Back-to-back short jobs: waits succeed while polling and earn the budget back.
  std::vector<float> out(256);
  for (int round = 0; round < 20000 && pool.spin_budget() < max; ++round)
    pool.parallel_for(256, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) out[static_cast<size_t>(i)] = static_cast<float>(i);
    });
  EXPECT_EQ(pool.spin_budget(), max);
  // A pool that never polls keeps a zero budget.
  ThreadPool no_polling(2, 0us);
  no_polling.parallel_for(256, [&](int64_t, int64_t) {});
  EXPECT_EQ(no_polling.spin_budget(), std::chrono::nanoseconds::zero());
}

TEST(ThreadPool, ProcessPoolFollowsTheThreadCount) {
  ThreadCountGuard restore;
  for (int threads : {1, 3, 2}) {
    ops::set_thread_count(threads);
    EXPECT_EQ(process_pool()->threads(), threads);
  }
  ops::set_thread_count(0);
  EXPECT_EQ(process_pool()->threads(), ops::thread_count());
  EXPECT_GE(ops::thread_count(), 1);
}

// ---- Every parallel CPU op gives the same bits at every thread count. ----

std::vector<float> random_floats(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out;
  for (float x : v) out.push_back(f32_to_bf16(x));
  return out;
}

// Runs every op once (shapes above each op's parallel threshold) and returns all outputs.
std::vector<float> run_parallel_ops() {
  std::mt19937 rng(1234);
  std::vector<float> all;
  auto keep = [&](const std::vector<float>& v) { all.insert(all.end(), v.begin(), v.end()); };

  // linear: bf16 [300, 256] (150 KB), decode- and prefill-shaped m.
  const int64_t n = 300, k = 256;
  const auto wbits = to_bf16(random_floats(n * k, rng));
  const ops::WeightRef w{DType::BF16, wbits.data(), n, k, {}};
  for (int64_t m : {1, 3, 9}) {
    const auto x = random_floats(m * k, rng);
    std::vector<float> y(m * n);
    ops::linear(x.data(), m, w, y.data());
    keep(y);
  }

  // linear_quantized: 4-bit, groups of 64.
  {
    std::vector<uint8_t> packed(n * k / 2);
    for (auto& b : packed) b = static_cast<uint8_t>(rng());
    const auto scales = random_floats(n * (k / 64), rng, 0.01f, 0.1f);
    const auto biases = random_floats(n * (k / 64), rng, -0.1f, 0.1f);
    ops::QuantWeightRef q;
    q.packed = packed.data();
    q.scales = {DType::F32, scales.data(), n, k / 64, {}};
    q.biases = {DType::F32, biases.data(), n, k / 64, {}};
    q.rows = n;
    q.cols = k;
    q.group_size = 64;
    q.bits = 4;
    const auto x = random_floats(2 * k, rng);
    std::vector<float> y(2 * n);
    ops::linear_quantized(x.data(), 2, q, y.data());
    keep(y);
  }

  // rms_norm, gated_rms_norm: 17 rows.
  {
    const int64_t m = 17, d = 128;
    const auto x = random_floats(m * d, rng), z = random_floats(m * d, rng);
    const auto g = random_floats(d, rng);
    const ops::WeightRef gw{DType::F32, g.data(), 1, d, {}};
    std::vector<float> y(m * d), yg(m * d);
    ops::rms_norm(x.data(), m, d, gw, true, 1e-6f, y.data());
    ops::gated_rms_norm(x.data(), z.data(), m, d, gw, 1e-6f, yg.data());
    keep(y);
    keep(yg);
  }

  // swiglu over 70,000 values.
  {
    const auto gate = random_floats(70000, rng), up = random_floats(70000, rng);
    std::vector<float> out(70000);
    ops::swiglu(gate.data(), up.data(), 70000, out.data());
    keep(out);
  }

  // causal_conv_silu: 300 channels, kernel 4, 5 tokens.
  {
    const int64_t C = 300, K = 4, T = 5;
    const auto x = random_floats(T * C, rng), cw = random_floats(C * K, rng);
    auto state = random_floats(C * (K - 1), rng);
    std::vector<float> out(T * C), after(T * C * (K - 1));
    ops::causal_conv_silu(x.data(), T, C, K, {DType::F32, cw.data(), C, K, {}}, state.data(),
                          out.data(), after.data());
    keep(out);
    keep(after);
    keep(state);
  }

  // gated_delta_rule: 2 key heads, 4 value heads of 32 x 32, 5 tokens.
  {
    const ops::DeltaHeads h{2, 4, 32, 32};
    const int64_t T = 5;
    const auto q = random_floats(T * h.n_k_heads * h.dk, rng);
    const auto kk = random_floats(T * h.n_k_heads * h.dk, rng);
    const auto v = random_floats(T * h.n_v_heads * h.dv, rng);
    const auto a = random_floats(T * h.n_v_heads, rng), b = random_floats(T * h.n_v_heads, rng);
    const auto A_log = random_floats(h.n_v_heads, rng), dt = random_floats(h.n_v_heads, rng);
    auto state = random_floats(h.n_v_heads * h.dk * h.dv, rng, -0.1f, 0.1f);
    std::vector<float> out(T * h.n_v_heads * h.dv), after(T * h.n_v_heads * h.dk * h.dv);
    ops::gated_delta_rule(q.data(), kk.data(), v.data(), a.data(), b.data(),
                          {DType::F32, A_log.data(), 1, h.n_v_heads, {}},
                          {DType::F32, dt.data(), 1, h.n_v_heads, {}}, T, h, state.data(),
                          out.data(), after.data());
    keep(out);
    keep(after);
    keep(state);
  }

  // attention: 40 tokens over a paged cache of 16-slot blocks, 8 query heads on 2 kv heads.
  {
    const int64_t bs = 16, nkv = 2, hd = 64, nh = 8, L = 40;
    const std::vector<int32_t> table = {2, 0, 1};
    auto pool = random_floats(3 * 2 * bs * nkv * hd, rng);
    const ops::KVLayerView kv{pool.data(), bs, nkv, hd};
    std::vector<int64_t> pos(L);
    for (int64_t t = 0; t < L; ++t) pos[t] = t;
    const auto q = random_floats(L * nh * hd, rng);
    std::vector<float> out(L * nh * hd);
    ops::attention(kv, table.data(), pos.data(), L, L, q.data(), nh, 0.125f, out.data());
    keep(out);
  }
  return all;
}

TEST(ThreadPool, CpuOpsGiveTheSameBitsAtEveryThreadCount) {
  ThreadCountGuard restore;
  ASSERT_EQ(ops::backend(), ops::Backend::Cpu);
  ops::set_thread_count(1);
  const std::vector<float> ref = run_parallel_ops();
  for (int threads : {2, 3, 4, 7}) {
    ops::set_thread_count(threads);
    const std::vector<float> got = run_parallel_ops();
    ASSERT_EQ(got.size(), ref.size());
    size_t first_diff = got.size();
    for (size_t i = 0; i < got.size() && first_diff == got.size(); ++i)
      if (std::memcmp(&got[i], &ref[i], sizeof(float)) != 0) first_diff = i;
    EXPECT_EQ(first_diff, got.size())
        << threads << " threads: first differing value " << first_diff;
  }
}

// ---- TANDEM_THREADS (read once per process, so checked through the command line). ----

struct CliRun {
  int code = -1;
  std::string out;
};

CliRun run_cli(const std::string& env, const std::string& args) {
  const std::string cmd = env + " " + TANDEM_BINARY + " " + args + " 2>&1";
  CliRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t got;
  while ((got = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), got);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

TEST(ThreadPool, TandemThreadsSetsTheDefaultThreadCount) {
  const std::string model = std::string(TANDEM_SOURCE_DIR) + "/models/qwen35-demo";
  const std::string gen =
      "generate --model " + model + " --prompt 'def f(x):' --max-tokens 3 --json";
  const CliRun three = run_cli("TANDEM_THREADS=3", gen + " --backend cpu");
  ASSERT_EQ(three.code, 0) << three.out;
  EXPECT_NE(three.out.find("\"threads\":3"), std::string::npos) << three.out;
  // --threads wins over the environment.
  const CliRun flag = run_cli("TANDEM_THREADS=3", gen + " --backend cpu --threads 1");
  ASSERT_EQ(flag.code, 0) << flag.out;
  EXPECT_NE(flag.out.find("\"threads\":1"), std::string::npos) << flag.out;
  const CliRun bad = run_cli("TANDEM_THREADS=two", gen + " --backend cpu");
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_NE(bad.out.find("TANDEM_THREADS='two'"), std::string::npos) << bad.out;
}

}  // namespace
}  // namespace tandem::cpu
