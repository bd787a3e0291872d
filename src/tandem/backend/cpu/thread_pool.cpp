#include "tandem/backend/cpu/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <climits>
#include <utility>

#include "tandem/backend/ops.h"
#include "tandem/core/error.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tandem::cpu {

namespace {

thread_local bool t_in_task = false;

// Sets t_in_task for a scope and restores it.
class TaskScope {
 public:
  TaskScope() : saved_(t_in_task) { t_in_task = true; }
  ~TaskScope() { t_in_task = saved_; }
  TaskScope(const TaskScope&) = delete;
  TaskScope& operator=(const TaskScope&) = delete;

 private:
  bool saved_;
};

// Sleeps while `word` holds `expected` (returns at once if it does not; may return spuriously).
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
#if defined(__linux__)
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                std::atomic<uint32_t>::is_always_lock_free);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
#else
  word.wait(expected, std::memory_order_seq_cst);
#endif
}

void futex_wake_all(std::atomic<uint32_t>& word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
#else
  word.notify_all();
#endif
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Polls `ready` for at most `budget`; true as soon as it holds, false when the budget is spent.
// The clock is read every 64 polls (a vDSO call costs about as much as 64 pauses).
template <class Pred>
bool poll_for(const Pred& ready, std::chrono::nanoseconds budget) {
  if (ready()) return true;
  if (budget <= std::chrono::nanoseconds::zero()) return false;
  const auto deadline = std::chrono::steady_clock::now() + budget;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      cpu_relax();
      if (ready()) return true;
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
  }
}

// Chunks of participant `index`'s home range: [chunks * index / threads, ... (index + 1) ...).
int64_t home_begin(int index, uint32_t chunks, int threads) {
  return int64_t{chunks} * index / threads;
}

}  // namespace

ThreadPool::ThreadPool(int threads, std::chrono::nanoseconds spin)
    : threads_(threads),
      max_spin_ns_(std::max<int64_t>(spin.count(), 0)),
      min_spin_ns_(std::min<int64_t>(max_spin_ns_, std::chrono::nanoseconds(kMinSpin).count())),
      spin_budget_(max_spin_ns_),
      slots_(static_cast<size_t>(std::max(threads, 1))) {
  TANDEM_CHECK(threads >= 1, "thread pool of ", threads, " threads");
  workers_.reserve(static_cast<size_t>(threads - 1));
  try {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_main(i); });
  } catch (...) {
    stop_workers();  // a std::thread still joinable at destruction would terminate the process
    throw;
  }
}

ThreadPool::~ThreadPool() {
  stop_workers();
}

void ThreadPool::stop_workers() {
  stop_.store(true, std::memory_order_relaxed);
  // The epoch bump releases stop_ to every worker, polling or asleep.
  epoch_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(epoch_);
  for (std::thread& w : workers_) w.join();
}

bool ThreadPool::in_task() {
  return t_in_task;
}

void ThreadPool::run(int64_t n, Task task) {
  if (n <= 0) return;
  // Nested calls are checked first: the caller of the enclosing job holds job_mutex_.
  if (threads_ == 1 || n == 1 || t_in_task) {
    task.fn(task.ctx, 0, n);
    return;
  }
  std::unique_lock<std::mutex> job(job_mutex_, std::try_to_lock);
  if (!job.owns_lock()) {
    task.fn(task.ctx, 0, n);
    return;
  }
  const auto chunks =
      static_cast<uint32_t>(std::min({n, int64_t{threads_} * kChunksPerThread, kMaxChunks}));

  // Every chunk of the previous job has finished, so the job fields are ours to rewrite.
  task_ = task;
  n_ = n;
  error_ = nullptr;
  failed_.store(false, std::memory_order_relaxed);
  ++generation_;
  target_ += chunks;
  // Publishing the job word releases the fields above to every thread that reads it.
  job_.store(static_cast<uint64_t>(generation_) << 32 | chunks, std::memory_order_release);
  // seq_cst store, then seq_cst load of sleepers_: pairs with the worker's increment of
  // sleepers_ before its re-check of epoch_, so either it sees this epoch or we see it asleep.
  epoch_.store(generation_, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(epoch_);

  {
    TaskScope scope;
    take_part(0, generation_, chunks);
  }
  wait_for_chunks();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

int64_t ThreadPool::claim(int home, uint32_t generation, uint32_t chunks) {
  const int64_t begin = home_begin(home, chunks, threads_);
  const int64_t size = home_begin(home + 1, chunks, threads_) - begin;
  std::atomic<uint64_t>& slot = slots_[static_cast<size_t>(home)].word;
  uint64_t word = slot.load(std::memory_order_relaxed);
  for (;;) {
    const auto slot_generation = static_cast<uint32_t>(word >> 32);
    // Generations wrap: compare by signed distance.
    if (static_cast<int32_t>(slot_generation - generation) > 0) return -1;
    const int64_t claimed = slot_generation == generation ? static_cast<uint32_t>(word) : 0;
    if (claimed >= size) return -1;
    const uint64_t next =
        static_cast<uint64_t>(generation) << 32 | static_cast<uint64_t>(claimed + 1);
    // On failure `word` is reloaded: another thread claimed in this range meanwhile.
    if (slot.compare_exchange_weak(word, next, std::memory_order_relaxed)) return begin + claimed;
  }
}

void ThreadPool::take_part(int index, uint32_t generation, uint32_t chunks) {
  uint32_t ran = 0;
  // Home range first, then the others' in turn, each until it has nothing left to claim.
  for (int i = 0; i < threads_; ++i) {
    const int home = (index + i) % threads_;
    for (int64_t c; (c = claim(home, generation, chunks)) >= 0;) {
      // Chunk c is ours, so the job cannot finish, and its fields cannot change, until we
      // count it done below. (Having claimed it also proves `generation` is the current job:
      // a finished job has no unclaimed chunk left.)
      const int64_t begin = n_ * c / chunks;
      const int64_t end = n_ * (c + 1) / chunks;
      if (!failed_.load(std::memory_order_relaxed)) {
        try {
          task_.fn(task_.ctx, begin, end);
        } catch (...) {
          if (!failed_.exchange(true, std::memory_order_relaxed)) error_ = std::current_exception();
        }
      }
      ++ran;
    }
  }
  if (ran == 0) return;
  // The addition releases this thread's chunk writes (and error_) to the caller. seq_cst with
  // the load of caller_sleeping_: pairs with the caller's store of it before its re-check of
  // done_, so either the caller sees our count or we see it asleep (and wake it; it re-checks).
  done_.fetch_add(ran, std::memory_order_seq_cst);
  if (index != 0 && caller_sleeping_.load(std::memory_order_seq_cst)) futex_wake_all(done_);
}

template <class Pred>
bool ThreadPool::poll(const Pred& ready) {
  const int64_t budget = spin_budget_.load(std::memory_order_relaxed);
  const bool ok = poll_for(ready, std::chrono::nanoseconds(budget));
  const int64_t next =
      ok ? std::min(max_spin_ns_, budget + max_spin_ns_ / 8) : std::max(min_spin_ns_, budget / 2);
  // Stored only on a change: in steady state no wait writes the shared line.
  if (next != budget) spin_budget_.store(next, std::memory_order_relaxed);
  return ok;
}

void ThreadPool::wait_for_chunks() {
  const uint32_t target = target_;
  const auto finished = [&] { return done_.load(std::memory_order_acquire) == target; };
  if (poll(finished)) return;
  // A worker still runs a chunk after the polling budget: it was preempted (or the chunks are
  // long). Sleep so that, on a shared machine, it can have this core.
  caller_sleeping_.store(1, std::memory_order_seq_cst);
  for (uint32_t d; (d = done_.load(std::memory_order_seq_cst)) != target;) futex_wait(done_, d);
  caller_sleeping_.store(0, std::memory_order_relaxed);
}

uint32_t ThreadPool::wait_for_job(uint32_t seen) {
  const auto published = [&] { return epoch_.load(std::memory_order_acquire) != seen; };
  if (!poll(published)) {
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (epoch_.load(std::memory_order_seq_cst) == seen) futex_wait(epoch_, seen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }
  return epoch_.load(std::memory_order_acquire);
}

void ThreadPool::worker_main(int index) {
  t_in_task = true;  // a task's own parallel_for runs on this worker
  uint32_t seen = 0;
  for (;;) {
    seen = wait_for_job(seen);
    if (stop_.load(std::memory_order_relaxed)) return;
    // The job word may already be a later job than the epoch seen: either is fine to join.
    const uint64_t job = job_.load(std::memory_order_acquire);
    take_part(index, static_cast<uint32_t>(job >> 32), static_cast<uint32_t>(job & 0xffff));
  }
}

namespace {

// The process-wide pool and the lock that guards its replacement. Never destroyed: a forked
// child abandons it (its workers do not exist there, its mutex may be held by a thread that
// does not either) and starts a new one, keeping the old reachable through `abandoned`.
struct ProcessPool {
  std::mutex mutex;
  std::shared_ptr<ThreadPool> pool;
  ProcessPool* abandoned = nullptr;
};

std::atomic<bool> g_forked{false};

void on_fork_child() {
  g_forked.store(true, std::memory_order_relaxed);
}

ProcessPool*& process_pool_state() {
  static ProcessPool* state = [] {
    pthread_atfork(nullptr, nullptr, &on_fork_child);
    return new ProcessPool;
  }();
  return state;
}

}  // namespace

std::shared_ptr<ThreadPool> process_pool() {
  ProcessPool*& state = process_pool_state();
  // Only a forked child sees the flag, and it is single-threaded until it starts threads. (Load
  // first: no read-modify-write on every call.)
  if (g_forked.load(std::memory_order_relaxed) && g_forked.exchange(false)) {
    auto* fresh = new ProcessPool;
    fresh->abandoned = state;
    state = fresh;
  }
  const int threads = ops::thread_count();
  std::lock_guard<std::mutex> lock(state->mutex);
  // A pool being replaced is joined when its last user lets go of it.
  if (!state->pool || state->pool->threads() != threads)
    state->pool = std::make_shared<ThreadPool>(threads);
  return state->pool;
}

}  // namespace tandem::cpu
