// The threads the CPU kernels split their work over (cpu_pool.cpp).
//
// at::parallel_for (OpenMP) gives each thread one fixed share and returns when every thread has
// finished its own. On a machine whose cores other processes also use (a serving stack on a few
// cores: the scheduler, the gateway, the message bus) a thread that is preempted, or still waking,
// holds the whole op for as long as it is off its core, while the calling thread waits. Here the
// work is cut into several chunks per thread that the threads claim one at a time: the calling
// thread claims chunks too, and returns once every chunk is done, without waiting for a helper
// that never started; a late helper finds nothing left. A helper preempted inside a chunk still
// holds that chunk, which is why the chunks are small.
//
// Which thread computes a chunk never changes its result: every kernel here computes each output
// from its own inputs in one fixed order (the deterministic mode's batch invariance rests on it).
#pragma once

#include <cstdint>

namespace deepinfer {

using ChunkFn = void (*)(void* context, int64_t begin, int64_t end);

// fn(context, b, e) over [0, n) in chunks of at least `grain` items (the last may be shorter), on
// the calling thread and up to N - 1 helpers, N set by the op set_num_threads (0, the default:
// at::get_num_threads() on the calling thread). n < 2 * grain, N = 1, a call from inside a chunk,
// from another thread while a job runs, or in a child forked after the pool started: all of
// [0, n) on the calling thread. An exception from a chunk is rethrown here, after every claimed
// chunk has ended.
void run_chunks(int64_t n, int64_t grain, ChunkFn fn, void* context);

// f(begin, end) over [begin, end) as run_chunks splits it: at::parallel_for's contract (f sees
// disjoint ranges covering [begin, end), at least `grain` long but the last), not its split.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  struct Context {
    const F* f;
    int64_t base;
  } context{&f, begin};
  run_chunks(
      end - begin, grain,
      [](void* p, int64_t b, int64_t e) {
        const auto* c = static_cast<const Context*>(p);
        (*c->f)(c->base + b, c->base + e);
      },
      &context);
}

}  // namespace deepinfer
