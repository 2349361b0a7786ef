// run_chunks (pool.h): the calling thread and a few helper threads claim a job's chunks one at a
// time from one atomic ticket.
//
// The ticket packs the job's epoch (16 bits), how many helpers may take part (6), its number of
// chunks (21) and the next unclaimed chunk (21). A claim is one fetch_add: the value it returns
// says, by itself, whether the claim is a chunk of a live job, so a helper never reads a job that
// is not live. A job's fields (function, context, chunk size) are written before its ticket is
// published and stay valid until its last chunk is done, which the caller waits for; a claim past
// the last chunk only bumps the counter (each thread fails at most once per job: 21 bits hold
// that). Helpers spin a little after a job (the ops of a forward come back to back), then sleep
// on a condition variable; the caller wakes them only when one sleeps.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <pthread.h>


#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DEEPINFER_PAUSE() _mm_pause()
#else
#define DEEPINFER_PAUSE() std::this_thread::yield()
#endif

namespace {

using deepinfer::ChunkFn;

constexpr int64_t CHUNKS_PER_THREAD = 4;  // enough for the others to absorb a late thread's share
constexpr int MAX_HELPERS = 63;
constexpr auto HELPER_SPIN = std::chrono::microseconds(100);  // then sleep until the next job

constexpr int NEXT_BITS = 21, CHUNK_BITS = 21, HELPER_BITS = 6;
constexpr uint64_t NEXT_MASK = (1ull << NEXT_BITS) - 1, CHUNK_MASK = (1ull << CHUNK_BITS) - 1;
constexpr uint64_t HELPER_MASK = (1ull << HELPER_BITS) - 1;
constexpr int64_t MAX_CHUNKS = (1 << CHUNK_BITS) - 1 - MAX_HELPERS - 1;  // room for failed claims

struct Ticket {
  uint64_t epoch, helpers, num_chunks, next;
  static Ticket of(uint64_t t) {
    return {t >> (NEXT_BITS + CHUNK_BITS + HELPER_BITS), (t >> (NEXT_BITS + CHUNK_BITS)) & HELPER_MASK,
            (t >> NEXT_BITS) & CHUNK_MASK, t & NEXT_MASK};
  }
  uint64_t pack() const {
    return (epoch << (NEXT_BITS + CHUNK_BITS + HELPER_BITS)) | (helpers << (NEXT_BITS + CHUNK_BITS)) |
           (num_chunks << NEXT_BITS) | next;
  }
};

thread_local bool in_chunk = false;  // a kernel inside a chunk runs its own loops on its thread
std::atomic<int64_t> pool_threads{0};  // set_num_threads; 0: at::get_num_threads()
std::atomic<bool> forked_child{false};  // set in a child forked after the pool existed

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may outlive static destruction
    return *pool;
  }

  // False when this thread cannot run a job now (another thread's job runs); the caller then runs
  // the work itself.
  bool run(int64_t n, int64_t grain, int helpers, ChunkFn fn, void* context) {
    std::unique_lock<std::mutex> turn(run_mu_, std::try_to_lock);
    if (!turn.owns_lock()) return false;
    start_helpers(helpers);
    const int64_t threads = helpers + 1;
    const int64_t chunk = std::max<int64_t>(grain, (n + threads * CHUNKS_PER_THREAD - 1) / (threads * CHUNKS_PER_THREAD));
    const int64_t num_chunks = std::min<int64_t>(n / chunk + (n % chunk != 0), MAX_CHUNKS);
    fn_ = fn;
    context_ = context;
    n_ = n;
    chunk_ = std::max(chunk, n / num_chunks + (n % num_chunks != 0));  // every chunk >= grain but the last
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const Ticket last = Ticket::of(ticket_.load(std::memory_order_relaxed));
    ticket_.store(Ticket{last.epoch + 1, static_cast<uint64_t>(helpers), static_cast<uint64_t>(num_chunks), 0}.pack());
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    claim_all(-1);
    // Chunks other threads claimed and still run: spin briefly, then give the core away.
    for (int spins = 0; done_.load(std::memory_order_acquire) < num_chunks; ++spins) {
      if (spins < 4096) {
        DEEPINFER_PAUSE();
      } else {
        std::this_thread::yield();
      }
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  bool forked() const { return forked_child.load(std::memory_order_relaxed); }

 private:
  // A forked child's copy of the pool has no helpers, and its locks may have been held by one.
  Pool() { pthread_atfork(nullptr, nullptr, [] { forked_child.store(true); }); }

  void start_helpers(int count) {
    while (static_cast<int>(helpers_.size()) < count) {
      const int index = static_cast<int>(helpers_.size());
      helpers_.emplace_back([this, index] { helper_loop(index); });
      helpers_.back().detach();
    }
  }

  // Claims and runs chunks of the live job until none is left; `index` is the helper's (-1: the
  // caller). Returns the epoch it last saw.
  uint64_t claim_all(int index) {
    for (;;) {
      // A helper past the job's count stays out. It looks before it claims: a claim is taken
      // whatever its taker, and a claimed chunk must run. (A job published between the look and
      // the claim may get a helper more than it asked for; its result is the same.)
      const Ticket seen = Ticket::of(ticket_.load(std::memory_order_acquire));
      if (index >= static_cast<int>(seen.helpers)) return seen.epoch;
      const Ticket t = Ticket::of(ticket_.fetch_add(1, std::memory_order_acq_rel));
      if (t.next >= t.num_chunks) return t.epoch;
      const int64_t begin = static_cast<int64_t>(t.next) * chunk_;
      const int64_t end = std::min(n_, begin + chunk_);
      in_chunk = true;
      try {
        fn_(context_, begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      in_chunk = false;
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void helper_loop(int index) {
    uint64_t seen = Ticket::of(ticket_.load()).epoch;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + HELPER_SPIN;
      while (Ticket::of(ticket_.load(std::memory_order_acquire)).epoch == seen) {
        for (int i = 0; i < 64; ++i) DEEPINFER_PAUSE();
        if (std::chrono::steady_clock::now() < until) continue;
        std::unique_lock<std::mutex> lock(sleep_mu_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return Ticket::of(ticket_.load()).epoch != seen; });
        sleepers_.fetch_sub(1);
      }
      seen = claim_all(index);
    }
  }

  std::mutex run_mu_;  // one job at a time
  std::vector<std::thread> helpers_;
  // The ticket and the done count each on a cache line of their own: every claim writes the one
  // and every chunk's end the other, and a job's fields beside them would bounce between cores.
  alignas(64) std::atomic<uint64_t> ticket_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) ChunkFn fn_ = nullptr;
  void* context_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  std::mutex error_mu_;
  std::exception_ptr error_;
  std::mutex sleep_mu_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};

};

}  // namespace

namespace deepinfer {

void run_chunks(int64_t n, int64_t grain, ChunkFn fn, void* context) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = pool_threads.load(std::memory_order_relaxed);
  const int helpers = static_cast<int>(std::min<int64_t>(MAX_HELPERS, (threads > 0 ? threads : at::get_num_threads()) - 1));
  Pool& pool = Pool::get();
  // After a fork the helpers are gone (and a lock may be held by one): the child runs alone.
  if (helpers < 1 || grain > n / 2 || in_chunk || pool.forked() || !pool.run(n, grain, helpers, fn, context)) {
    fn(context, 0, n);
  }
}

}  // namespace deepinfer

namespace {

void set_num_threads(int64_t n) {
  TORCH_CHECK(n >= 0, "set_num_threads: n >= 0 (0: torch's number of threads)");
  pool_threads.store(n);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  // The kernels' threads, apart from torch's: a decode step can run its torch ops on one thread
  // (no OpenMP team spinning beside the pool) and the kernels on several.
  m.def("set_num_threads(int n) -> ()", &set_num_threads);
}
