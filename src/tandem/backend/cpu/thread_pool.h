// The CPU backend's thread pool: persistent workers that run a parallel-for together with the
// calling thread (the role libgomp played before; ggml's threadpool is the model).
//
// Why a pool of our own: a server shares its machine. libgomp's idle threads spin for a long
// time (OMP_WAIT_POLICY), and a team waits at every barrier for its slowest member; when a
// neighbour process takes a core, a spinning thread burns the time slice its preempted partner
// needs: on a 2-core machine next to one busy process, demo-model decode measured 5-42 tok/s
// (2 next to a compile) instead of ~1,400 alone. Here waiting is bounded (poll a few tens of
// microseconds, then sleep on a futex), and chunks are claimed, not assigned: each thread has a
// home range of chunks that it claims first, then it takes chunks still unclaimed in the
// others' ranges, so a worker the kernel has not scheduled delays no one.
//
// Contract of parallel_for(n, fn), fn(int64_t begin, int64_t end):
//  - [0, n) is cut into contiguous chunks whose boundaries depend only on n and the pool's
//    thread count; fn runs once per chunk, so every index is visited exactly once. Which thread
//    runs a chunk depends on timing, so fn must compute each index's result from that index
//    alone (no reduction across indices, scratch fully rewritten per index): then every number
//    is independent of the thread count and of timing. All of tandem's CPU kernels parallelise
//    this way over independent outputs (backend/ops.h).
//  - fn is called concurrently from several threads through a const reference.
//  - The caller runs chunks too, and returns when every chunk has finished.
//  - Runs fn(0, n) on the calling thread, with no synchronisation, when the pool has one
//    thread, when n is 1, when called from inside a task (nested parallel-for), or when another
//    thread is using the pool at that moment.
//  - An exception thrown by fn is captured; chunks not started yet are skipped; once every
//    running chunk has finished, the first exception is rethrown on the caller.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace tandem::cpu {

class ThreadPool {
 public:
  // How long a waiting thread polls before it sleeps, at most. Decode issues a parallel op every
  // 10-50 us, so a worker that polls this long finds the next op without a wake-up (a futex wake
  // costs ~5-50 us on a VM; never polling cost a third of decode speed). The budget adapts: a
  // poll that times out (the awaited thread was descheduled, or the machine is oversubscribed)
  // spent its whole budget of CPU time that another thread needed, so it halves the budget, down
  // to kMinSpin; a poll that succeeds earns back an eighth of the maximum. Idle decode sees a
  // timeout or two per token and keeps near the maximum; next to busy processes the budget
  // drops. Chosen with bench/shared_cores.sh (BENCHMARKS.md "Shared cores").
  static constexpr std::chrono::microseconds kDefaultSpin{50};
  static constexpr std::chrono::microseconds kMinSpin{2};
  // Chunks per participating thread. More than one lets the threads that run balance a call
  // when one of them starts late (woken from sleep, or preempted by another process).
  static constexpr int kChunksPerThread = 4;
  static constexpr int64_t kMaxChunks = 0xffff;  // what a slot and the job word can count

  // `threads` participants (>= 1): the calling thread of each parallel_for plus threads - 1
  // workers, started here and sleeping until the first call. `spin`: the polling budget's
  // maximum (and starting value); below kMinSpin it is fixed.
  explicit ThreadPool(int threads, std::chrono::nanoseconds spin = kDefaultSpin);
  // Joins the workers. No parallel_for may be running on the pool.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }
  // The current polling budget (see kDefaultSpin).
  std::chrono::nanoseconds spin_budget() const {
    return std::chrono::nanoseconds(spin_budget_.load(std::memory_order_relaxed));
  }

  template <class F>
  void parallel_for(int64_t n, const F& fn) {
    static_assert(std::is_invocable_v<const F&, int64_t, int64_t>,
                  "parallel_for: fn(int64_t begin, int64_t end) must be const-callable");
    run(n, Task{&invoke<F>, &fn});
  }

  // True on a pool worker, and on a caller while it runs chunks: a parallel_for there runs on
  // the calling thread.
  static bool in_task();

 private:
  struct Task {
    void (*fn)(const void* ctx, int64_t begin, int64_t end);
    const void* ctx;
  };
  template <class F>
  static void invoke(const void* ctx, int64_t begin, int64_t end) {
    (*static_cast<const F*>(ctx))(begin, end);
  }

  void run(int64_t n, Task task);
  void worker_main(int index);
  void stop_workers();  // tells every worker to exit and joins it
  // Participant `index` (0: the caller) claims and runs chunks of job `generation` (of `chunks`
  // chunks), its home range first, until no chunk is left unclaimed; then counts them done.
  void take_part(int index, uint32_t generation, uint32_t chunks);
  // Claims the next unclaimed chunk of participant `home`'s range in job `generation`; -1 when
  // the range is exhausted (or a later job has begun: the caller was a late worker).
  int64_t claim(int home, uint32_t generation, uint32_t chunks);
  // Polls `ready` for the current budget and adapts the budget to the outcome.
  template <class Pred>
  bool poll(const Pred& ready);
  // Returns the first epoch different from `seen`: polls, then sleeps on epoch_.
  uint32_t wait_for_job(uint32_t seen);
  // Returns once done_ reaches target_: polls, then sleeps on done_.
  void wait_for_chunks();

  const int threads_;
  const int64_t max_spin_ns_, min_spin_ns_;
  // Shared by the pool's waiting threads; relaxed, as a lost update only delays adaptation.
  std::atomic<int64_t> spin_budget_;
  std::vector<std::thread> workers_;
  // Held by the caller for a whole job; a second thread that finds it taken runs serially.
  std::mutex job_mutex_;

  // The job being run. Written by the caller only between jobs; read by a thread only after it
  // has claimed a chunk of the job, which keeps the job from finishing (so from being
  // overwritten) until that chunk is counted done.
  Task task_{};
  int64_t n_ = 0;
  std::exception_ptr error_;  // the first exception; written once per job (failed_ elects)
  uint32_t generation_ = 0;   // caller only: jobs published
  uint32_t target_ = 0;       // caller only: done_ once every chunk so far has finished

  // A participant's claims in the job of generation `word >> 32`: the low bits count the chunks
  // of its home range claimed so far. A generation older than the current job's reads as zero
  // claims, so nothing is reset between jobs; one newer than a claimant's job tells a late
  // worker it has nothing left to do. Own cache line each: claims in one's own range stay local.
  struct alignas(64) Slot {
    std::atomic<uint64_t> word{0};
  };
  std::vector<Slot> slots_;

  // Published by the caller: generation << 32 | chunk count (at most kMaxChunks).
  alignas(64) std::atomic<uint64_t> job_{0};
  // Futex word of idle workers: the generation of the last job (bumped once more to stop).
  // sleepers_ counts workers asleep on it, so the caller skips the wake-up syscall while all
  // of them are still polling.
  std::atomic<uint32_t> epoch_{0};
  std::atomic<uint32_t> sleepers_{0};
  std::atomic<bool> stop_{false};
  // Chunks finished, over all jobs (wraps; compared for equality with target_). Each
  // participant adds its count once per job.
  alignas(64) std::atomic<uint32_t> done_{0};
  std::atomic<uint32_t> caller_sleeping_{0};  // the caller sleeps on done_: wake it
  std::atomic<bool> failed_{false};           // a chunk threw: run no more chunks of this job
};

// The process-wide pool with ops::thread_count() participants: created on first use, rebuilt
// when the thread count changes, and never destroyed (its workers sleep in the kernel at exit).
std::shared_ptr<ThreadPool> process_pool();

// ThreadPool::parallel_for on the process-wide pool. `parallel` false runs fn(0, n) on the
// calling thread: for calls too small to repay a fork and join (the result is the same).
template <class F>
void parallel_for(int64_t n, const F& fn, bool parallel = true) {
  if (n <= 0) return;
  if (!parallel || n == 1 || ThreadPool::in_task()) {
    fn(int64_t{0}, n);
    return;
  }
  process_pool()->parallel_for(n, fn);
}

}  // namespace tandem::cpu
