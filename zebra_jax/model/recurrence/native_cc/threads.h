// How a call's work goes over threads: the calling one and XLA's own pool
// (the one that runs its CPU ops), no more than the caller's `threads`,
// which native.py sizes to the work. Plan and Run hand out independent
// tasks (whole stripes, or a stripe's batch rows), each run start to end
// with no synchronisation between time steps; RunLockstep moves parts
// (a stripe's hidden units, Units) step by step together. No thread ever
// waits for one that has not started: a pool thread busy with other XLA
// work when the call begins takes fewer parts, or none.
//
// Part of native.cc's one translation unit: an unnamed namespace, as there.

#ifndef ZEBRA_NATIVE_THREADS_H_
#define ZEBRA_NATIVE_THREADS_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A stripe's hidden units [first, last) for part p of parts: whole vectors
// but for the last part's.
std::pair<int, int> Units(int g, int parts, int p) {
  auto edge = [&](int i) {
    return i == parts ? g : int(int64_t(g / kLanes) * i / parts) * kLanes;
  };
  return {edge(p), edge(p + 1)};
}

// The parts a stripe's units split into: no more than its whole vectors.
int UnitParts(int g, int64_t parts) {
  return int(std::max<int64_t>(1, std::min<int64_t>(parts, g / kLanes)));
}

// One (stripe, batch rows) share of a window.
struct Task { int stripe, row0, rows; };

// Tasks in order over at most `threads` threads, as even as they go.
template <typename T>
std::vector<std::vector<T>> Spread(const std::vector<T>& tasks, int threads) {
  const size_t used = std::min<size_t>(std::max(threads, 1), tasks.size());
  std::vector<std::vector<T>> plan(used);
  for (size_t t = 0; t < tasks.size(); ++t)
    plan[t * used / tasks.size()].push_back(tasks[t]);
  return plan;
}

// Splits S stripes x B rows over at most `threads` threads: whole stripes
// when there are enough, else each stripe's rows in equal parts. Empty when
// there is no work (S = 0 or B = 0).
std::vector<std::vector<Task>> Plan(int s, int b, int threads) {
  if (s <= 0 || b <= 0) return {};
  threads = std::max(1, threads);
  const int parts = std::min(b, std::max(1, (threads + s - 1) / s));
  std::vector<Task> tasks;
  for (int i = 0; i < s; ++i)
    for (int p = 0; p < parts; ++p) {
      const int r0 = int(int64_t(b) * p / parts);
      const int r1 = int(int64_t(b) * (p + 1) / parts);
      tasks.push_back({i, r0, r1 - r0});
    }
  return Spread(tasks, threads);
}

// What the calling thread and the pool's share: parts are claimed one at a
// time, so a pool thread that starts late (busy with other XLA work) takes
// fewer or none, and the caller never waits for work nobody has started.
// Held by shared_ptr: a pool thread may start after the call has returned,
// find nothing to claim and leave without touching `work`.
struct Shared {
  const std::function<void(size_t)>* work;
  size_t parts;
  std::atomic<size_t> next{0};
  size_t done = 0;  // under mu
  std::exception_ptr error;  // under mu: the first part's exception
  std::mutex mu;
  std::condition_variable finished;

  // Runs parts until none is left unclaimed.
  void Drain() {
    for (size_t i; (i = next.fetch_add(1)) < parts;) {
      std::exception_ptr failed;
      try {
        (*work)(i);
      } catch (...) {
        failed = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu);
      if (failed && !error) error = failed;
      if (++done == parts) finished.notify_all();
    }
  }
};

// Runs work(plan[i]) for every i: on the calling thread and up to
// plan.size() - 1 of XLA's pool threads. Rethrows a part's exception once
// every part has finished.
template <typename T, typename F>
void Run(const std::vector<std::vector<T>>& plan, ffi::ThreadPool* pool,
         F&& run_task) {
  if (plan.empty()) return;
  const std::function<void(size_t)> work = [&](size_t i) {
    for (const T& t : plan[i]) run_task(t);
  };
  if (plan.size() == 1 || pool == nullptr) {
    for (size_t i = 0; i < plan.size(); ++i) work(i);
    return;
  }
  auto shared = std::make_shared<Shared>();
  shared->work = &work;
  shared->parts = plan.size();
  try {
    for (size_t i = 1; i < plan.size(); ++i)
      pool->Schedule([shared] { shared->Drain(); });
  } catch (...) {  // could not hand out more: this thread runs the rest
  }
  shared->Drain();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->finished.wait(lock, [&] { return shared->done == shared->parts; });
  if (shared->error) std::rethrow_exception(shared->error);
}

// One wait of a spin: a pause, and the core given up now and then (the
// thread awaited may be waiting for it).
inline void Spin(int& spins) {
  if (++spins % 4096 == 0) {
    std::this_thread::yield();
  } else {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
}

// Step i of every part after step i - 1 of all of them, parts claimed one
// at a time as Shared's are: a thread takes part (its rank + k) % parts
// first, so each keeps its own part (and its columns of W in its cache)
// step after step, and takes over the parts of a thread that has not come.
// A thread waits only for steps whose every part it has seen claimed (it
// tried them all), by threads that are running them: no thread ever waits
// for one that has not started. Held by shared_ptr, as Shared.
struct Lockstep {
  const std::function<void(int, int64_t)>* work;
  int parts;
  int64_t steps;
  std::atomic<int> joined{0};
  std::atomic<int64_t> done{0};  // parts finished, every step together
  std::unique_ptr<std::atomic<int64_t>[]> claimed;  // a part's last step
  std::mutex mu;
  std::exception_ptr error;  // under mu: the first part's exception

  Lockstep(const std::function<void(int, int64_t)>* w, int p, int64_t n)
      : work(w), parts(p), steps(n),
        claimed(new std::atomic<int64_t>[p]) {
    for (int i = 0; i < p; ++i) claimed[i].store(-1);
  }

  void Join() {
    const int rank = joined.fetch_add(1);
    for (int64_t i = done.load() / parts; i < steps; ++i) {
      for (int spins = 0; done.load(std::memory_order_acquire) < i * parts;)
        Spin(spins);
      for (int k = 0; k < parts; ++k) {
        const int p = (rank + k) % parts;
        int64_t before = i - 1;
        if (!claimed[p].compare_exchange_strong(before, i)) continue;
        try {
          (*work)(p, i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu);
          if (!error) error = std::current_exception();
        }
        done.fetch_add(1, std::memory_order_release);
      }
    }
  }
};

// Runs work(p, i) for every part p at step i = 0, 1, ..., steps - 1, step
// by step: on the calling thread and up to parts - 1 of XLA's pool threads.
template <typename F>
void RunLockstep(int parts, int64_t steps, ffi::ThreadPool* pool, F&& step) {
  if (parts <= 0 || steps <= 0) return;
  const std::function<void(int, int64_t)> work = step;
  auto shared = std::make_shared<Lockstep>(&work, parts, steps);
  if (pool != nullptr) {
    try {
      for (int i = 1; i < parts; ++i)
        pool->Schedule([shared] { shared->Join(); });
    } catch (...) {  // could not hand out more: this thread runs the rest
    }
  }
  shared->Join();
  for (int spins = 0; shared->done.load(std::memory_order_acquire) <
                      parts * steps;)
    Spin(spins);
  if (shared->error) std::rethrow_exception(shared->error);
}

}  // namespace

#endif  // ZEBRA_NATIVE_THREADS_H_
