// A ZebraLSTM layer's time loops on a CPU: one XLA FFI call per loop (the
// backward one with the window's weight gradients where it can).
//
// Why hand-written: XLA's CPU backend runs every time step of a lax.scan as
// separate ops (a matmul, a gate fusion, one write per output window), one
// after another on one thread, and none of the libraries it calls has a
// kernel for a block-diagonal (striped) LSTM step. Here a step is one pass:
// the recurrent matmul accumulates onto the projected inputs in registers,
// the gate math runs on the rows it has just written, and every window is
// written once where the backward pass will read it. Stripes never read each
// other's state, so each thread runs the whole window of its own stripes
// (or, with fewer stripes than threads, of its own batch rows) with no
// synchronisation between time steps; a large dense stripe splits by
// hidden units instead, its threads in step (ForwardUnits).
//
// Layouts are scan.py's: stripe-major, row-major, float32.
//   x_proj, gates, dz [S, T, B, 4G]   gates [i | f | g | o] within a stripe
//   ys, cs, d_ys      [S, T, B, G]
//   h, c              [S, B, G]
//   w_h               [S, G, 4G]   (forward)
//   w_t               [S, 4G, G]   (backward: W_h^T, read row by row as the
//                                  forward reads W_h)
//   x                 [S, T, B, I/S] (grouped) or [T, B, I] (dense): the
//                                  layer's inputs, for W_x's gradient
// The matmuls and the cell are exact float32 arithmetic but for tanh, a
// rational approximation (the one XLA's CPU backend uses; largest error
// against float64 about 3.5e-7). NaN and infinities go through every step as
// they do through the scan's: tanh keeps a NaN (only finite values are
// clamped), and the backward pass multiplies the same factors.
//
// Portable C++ with GCC/Clang vector extensions, one vector a register of
// whatever -march targets (AVX-512, AVX2, SSE2, NEON). Threads: the calling one and XLA's own pool
// (the one that runs its CPU ops), no more than the caller's `threads`,
// which native.py sizes to the work: a sampling step (T = 1,
// B = 1) runs on the calling thread alone.

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One vector register of floats (kLanes), and the register block of the
// recurrent matmul: kRows rows x kVectors vectors of accumulators, plus
// kVectors of W and one broadcast, within the register file (AVX-512 and
// NEON 32 registers, AVX2 and SSE 16). A vector wider than a register
// would make AVX2 spill its accumulators: that build ran 7.9x slower.
// AVX-512: at dense S=1 (hidden 512) 8 x 2 ran about 1.25x faster than
// 4 x 4 (half the W loads a multiply-add) and 1.05-1.2x faster than 6 x 4
// and 8 x 3 (a narrower panel of W); AVX2's 6 x 2 beat 4 x 3, 4 x 2 and
// 5 x 2.
#if defined(__AVX512F__)
constexpr int kLanes = 16, kRows = 8, kVectors = 2;  // 16 + 2 + 1 of 32 zmm
#elif defined(__AVX__)
constexpr int kLanes = 8, kRows = 6, kVectors = 2;   // 12 + 2 + 1 of 16 ymm
#elif defined(__aarch64__)
constexpr int kLanes = 4, kRows = 4, kVectors = 4;   // 16 + 4 + 1 of 32 q
#else
constexpr int kLanes = 4, kRows = 4, kVectors = 2;   // SSE2, no FMA: 8 + 2
#endif                                               // + 2 of 16 xmm
// aligned(4): loads and stores at any float address.
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)),
                                 aligned(4)));

inline Vec Load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }
template <size_t... I>
inline Vec Splat(float x, std::index_sequence<I...>) {
  return Vec{((void)I, x)...};
}
// One broadcast (Vec{} + x would add a zero first).
inline Vec Splat(float x) { return Splat(x, std::make_index_sequence<kLanes>()); }

// Keeps a loaded W vector in a register, read once for all kRows rows
// (folded into every FMA instead, the loads bound the loop). The
// constraint names the target's vector registers.
#if defined(__AVX512F__)
#define ZEBRA_IN_REGISTER(v) asm("" : "+v"(v))
#elif defined(__SSE2__)
#define ZEBRA_IN_REGISTER(v) asm("" : "+x"(v))
#elif defined(__aarch64__)
#define ZEBRA_IN_REGISTER(v) asm("" : "+w"(v))
#else
#define ZEBRA_IN_REGISTER(v) (void)(v)
#endif

inline float Min(float a, float b) { return a < b ? a : b; }
inline float Max(float a, float b) { return a > b ? a : b; }
inline float Select(bool m, float a, float b) { return m ? a : b; }
inline Vec Min(Vec a, Vec b) { return a < b ? a : b; }
inline Vec Max(Vec a, Vec b) { return a > b ? a : b; }
template <typename M>
inline Vec Select(M m, Vec a, Vec b) { return m ? a : b; }
inline float Abs(float a) { return a < 0 ? -a : a; }
inline Vec Abs(Vec a) { return a < 0 ? -a : a; }

// a in [-bound, bound], NaN kept: both comparisons are false for NaN (a
// min/max would pick the bound, turning a NaN into +-1 after tanh).
template <typename T>
inline T Clamp(T a, float bound) {
  const T x = Select(a > bound, T{} + bound, a);
  return Select(x < -bound, T{} - bound, x);
}

// tanh as a 13/6 rational function on [-7.9988, 7.9988], x itself near 0,
// exactly +-1 beyond (where XLA's is too: a saturated gate's derivative is
// then exactly 0, as the scan's, and an infinite input times it NaN).
template <typename T>
inline T Tanh(T a) {
  constexpr float kSaturated = 7.99881172180175781f;
  const T x = Clamp(a, kSaturated);
  const T x2 = x * x;
  T p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = x2 * p + -8.60467152213735e-11f;
  p = x2 * p + 5.12229709037114e-08f;
  p = x2 * p + 1.48572235717979e-05f;
  p = x2 * p + 6.37261928875436e-04f;
  p = x2 * p + 4.89352455891786e-03f;
  T q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = x2 * q + 2.26843463243900e-03f;
  q = x2 * q + 4.89352518554385e-03f;
  const T one = Select(a < 0, T{} - 1.0f, T{} + 1.0f);
  const T abs = Abs(a);  // NaN: every comparison false, x * p / q is NaN
  return Select(abs < 0.0004f, a, Select(abs >= kSaturated, one, x * p / q));
}

// Strides and row offsets are 64-bit: rows x 4G of a window may pass 2^31.
using Index = int64_t;

// One product of a sum: A[rows, k] W[k, columns], row strides lda and ldw.
struct Term {
  int k;
  const float* a;
  Index lda;
  const float* w;
  Index ldw;
};

// C[R, V*kLanes] = X + the terms' A W (X null: 0), in registers: a sum of
// two products (a step's projected inputs and recurrence) never leaves
// them. X may be C itself: a block is read whole before it is written.
template <int R, int V, size_t N>
inline void Block(const std::array<Term, N>& terms, const float* x,
                  Index ldx, float* c, Index ldc) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = x ? Load(x + r * ldx + v * kLanes) : Vec{};
  for (const Term& t : terms)
    for (int k = 0; k < t.k; ++k) {
      Vec wk[V];
      for (int v = 0; v < V; ++v) {
        wk[v] = Load(t.w + k * t.ldw + v * kLanes);
        ZEBRA_IN_REGISTER(wk[v]);
      }
      for (int r = 0; r < R; ++r) {
        const Vec ak = Splat(t.a[r * t.lda + k]);
        for (int v = 0; v < V; ++v) acc[r][v] += ak * wk[v];
      }
    }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(c + r * ldc + v * kLanes, acc[r][v]);
}

// The terms' rows from row r on.
template <size_t N>
inline std::array<Term, N> FromRow(std::array<Term, N> terms, Index r) {
  for (Term& t : terms) t.a += r * t.lda;
  return terms;
}

// Rows [r, rows) of a column block: kRows at a time, then the remainder
// as one smaller block.
template <int V, int R = kRows, size_t N>
inline void Columns(int rows, const std::array<Term, N>& terms,
                    const float* x, Index ldx, float* c, Index ldc) {
  Index r = 0;
  for (; r + R <= rows; r += R)
    Block<R, V>(FromRow(terms, r), x ? x + r * ldx : nullptr, ldx,
                c + r * ldc, ldc);
  if constexpr (R > 1) {
    if (r < rows)
      Columns<V, R - 1>(rows - r, FromRow(terms, r),
                        x ? x + r * ldx : nullptr, ldx, c + r * ldc, ldc);
  }
}

// One product's Columns: C = X + A[rows, k] W[k, V*kLanes].
template <int V>
inline void Columns(int rows, int k_size, const float* a, Index lda,
                    const float* w, Index ldw, const float* x, Index ldx,
                    float* c, Index ldc) {
  Columns<V>(rows, std::array<Term, 1>{Term{k_size, a, lda, w, ldw}}, x, ldx,
             c, ldc);
}

// f(j, Vec{}) for kLanes elements from j at a time, then f(j, 0.0f) for the
// rest: the same code, vector and scalar.
template <typename F>
inline void Lanes(int n, F&& f) {
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) f(j, Vec{});
  for (; j < n; ++j) f(j, 0.0f);
}

template <typename T>
inline T Get(const float* p, T) {
  if constexpr (sizeof(T) == sizeof(float)) return *p; else return Load(p);
}
inline void Put(float* p, float v) { *p = v; }
inline void Put(float* p, Vec v) { Store(p, v); }

// c[n] = x + a[k] W[k, n] for a batch of one row (sampling): W read row by
// row, in the order it lies in memory, the sums kept in c (a row of 4G
// floats stays in L1). A register block walks W's columns with the stride
// of a whole row, which the prefetchers follow badly: a dense S=1 layer's
// step at B = 1 took 1.2x the time.
void RowTimesMatrix(int n, int k_size, const float* a, const float* w,
                    Index ldw, const float* x, float* c) {
  for (int j = 0; j < n; ++j) c[j] = x ? x[j] : 0.0f;
  for (int k = 0; k < k_size; ++k) {
    const float ak = a[k];
    const float* wk = w + k * ldw;
    Lanes(n, [&](int j, auto u) {
      Put(c + j, Get(c + j, u) + ak * Get(wk + j, u));
    });
  }
}

struct Shape {
  int64_t s, t, b, g;
};

// The columns one register block covers: W is packed by panels this wide.
constexpr int kPanel = kVectors * kLanes;

// Columns [0, n) of W[k, ldw] (row stride ldw) as panels of kPanel
// columns, each panel's k rows one after another: what a register block
// reads is then contiguous. Read in place, a block's rows lie a whole row
// of W apart (8 KB at dense S=1, hidden 512): every k touched a new page,
// where the L2 prefetchers stop, and the recurrent matmul ran at a third of
// the machine's best. Columns past the last whole panel are not packed
// (Matmul reads them in place).
void Pack(int k_size, int n, const float* w, Index ldw, float* panels) {
  for (int j = 0; j + kPanel <= n; j += kPanel)
    for (int k = 0; k < k_size; ++k)
      std::copy(w + k * ldw + j, w + k * ldw + j + kPanel,
                panels + Index(j) * k_size + Index(k) * kPanel);
}

// Floats Pack writes for n columns of k_size rows.
Index PackedSize(int k_size, int n) {
  return Index(n / kPanel) * kPanel * k_size;
}

// One product of a Matmul: A[rows, k] W[k, n], W row-major with row stride
// ldw, its whole panels also packed (Pack) in `panels`.
struct Product {
  Term term;
  const float* panels;
};

// C[rows, n] = X + the products' sum, in the products' order.
template <size_t N>
void Matmul(int rows, int n, const std::array<Product, N>& products,
            const float* x, Index ldx, float* c, Index ldc) {
  auto terms = [&](int j, bool packed) {
    std::array<Term, N> t;
    for (size_t i = 0; i < N; ++i) {
      const Term& p = products[i].term;
      t[i] = packed ? Term{p.k, p.a, p.lda,
                           products[i].panels + Index(j) * p.k, kPanel}
                    : Term{p.k, p.a, p.lda, p.w + j, p.ldw};
    }
    return t;
  };
  int j = 0;
  for (; j + kPanel <= n; j += kPanel)
    Columns<kVectors>(rows, terms(j, true), x ? x + j : nullptr, ldx, c + j,
                      ldc);
  for (; j + kLanes <= n; j += kLanes)
    Columns<1>(rows, terms(j, false), x ? x + j : nullptr, ldx, c + j, ldc);
  for (; j < n; ++j)
    for (Index r = 0; r < rows; ++r) {
      float sum = x ? x[r * ldx + j] : 0.0f;
      for (const Product& product : products) {
        const Term& p = product.term;
        for (Index k = 0; k < p.k; ++k)
          sum += p.a[r * p.lda + k] * p.w[k * p.ldw + j];
      }
      c[r * ldc + j] = sum;
    }
}

// C[rows, n] = X + A[rows, k] W[k, n]: one product.
void Matmul(int rows, int n, int k_size, const float* a, Index lda,
            const float* w, Index ldw, const float* panels, const float* x,
            Index ldx, float* c, Index ldc) {
  Matmul(rows, n,
         std::array<Product, 1>{{{{k_size, a, lda, w, ldw}, panels}}}, x,
         ldx, c, ldc);
}

// Column ranges [first, last) of every stripe's W[k_size, ldw], each
// range's whole panels packed one after another (nothing where a call runs
// one row: RowTimesMatrix reads W in place).
class Packed {
 public:
  Packed(const Shape& d, int k_size, int ldw, const float* w,
         const std::vector<std::pair<int, int>>& ranges) {
    if (d.b <= 1) return;
    for (const auto& [first, last] : ranges) {
      offsets_.push_back(per_stripe_);
      per_stripe_ += PackedSize(k_size, last - first);
    }
    panels_.resize(per_stripe_ * d.s);
    for (int64_t s = 0; s < d.s; ++s)
      for (size_t i = 0; i < ranges.size(); ++i)
        Pack(k_size, ranges[i].second - ranges[i].first,
             w + (s * k_size) * ldw + ranges[i].first, ldw,
             panels_.data() + s * per_stripe_ + offsets_[i]);
  }
  const float* Panels(int64_t stripe, size_t range) const {
    return panels_.empty() ? nullptr
                           : panels_.data() + stripe * per_stripe_ +
                                 offsets_[range];
  }

 private:
  std::vector<float> panels_;
  std::vector<Index> offsets_;
  Index per_stripe_ = 0;
};

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

// Splits S stripes x B rows over at most `threads` threads: whole stripes
// when there are enough, else each stripe's rows in equal parts. Empty when
// there is no work (S = 0 or B = 0).
// Tasks in order over at most `threads` threads, as even as they go.
template <typename T>
std::vector<std::vector<T>> Spread(const std::vector<T>& tasks, int threads) {
  const size_t used = std::min<size_t>(std::max(threads, 1), tasks.size());
  std::vector<std::vector<T>> plan(used);
  for (size_t t = 0; t < tasks.size(); ++t)
    plan[t * used / tasks.size()].push_back(tasks[t]);
  return plan;
}

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

// The gates of one row's units [u0, u1): z = act(z) in place, sigmoid(x) =
// (1 + tanh(x / 2)) / 2 for i, f, o, tanh for g.
inline void Activate(float* zr, int g, int u0, int u1) {
  for (int q = 0; q < 4; ++q) {
    const float half = q == 2 ? 1.0f : 0.5f;
    float* zq = zr + q * g + u0;
    Lanes(u1 - u0, [&](int j, auto u) {
      Put(zq + j, Tanh(Get(zq + j, u) * half) * half + (1.0f - half));
    });
  }
}

// One row's cell on units [u0, u1): c and h from the activated gates; h
// into y (and hr where not null), c into cr (and csr where not null).
inline void Cell(const float* zr, int g, int u0, int u1, float* cr,
                 float* hr, float* yr, float* csr) {
  Lanes(u1 - u0, [&](int jj, auto u) {
    using T = decltype(u);
    const int j = u0 + jj;
    const T cn = Get(zr + g + j, u) * Get(cr + j, u) +
                 Get(zr + j, u) * Get(zr + 2 * g + j, u);
    const T hn = Get(zr + 3 * g + j, u) * Tanh(cn);
    Put(cr + j, cn);
    if (hr) Put(hr + j, hn);
    Put(yr + j, hn);
    if (csr) Put(csr + j, cn);
  });
}

// One row's step back on units [u0, u1): the pre-activation gradients into
// zr from the carried dh (plus dy) and dc; dc carried on. Each gradient is
// (carried gradient) x (the scan's factor, multiplied in the scan's order):
// an overflow or an inf x 0 gives the scan's inf or NaN.
inline void CellBack(const float* gr, const float* cr, const float* cp,
                     const float* dyr, const float* dhr, float* dcr,
                     float* zr, int g, int u0, int u1) {
  Lanes(u1 - u0, [&](int jj, auto u) {
    using T = decltype(u);
    const int j = u0 + jj;
    const T i = Get(gr + j, u), f = Get(gr + g + j, u);
    const T gg = Get(gr + 2 * g + j, u), o = Get(gr + 3 * g + j, u);
    const T tc = Tanh(Get(cr + j, u));
    const T dhj = Get(dhr + j, u) + Get(dyr + j, u);
    const T dcj = Get(dcr + j, u) + dhj * (o * (1.0f - tc * tc));
    Put(zr + j, dcj * (gg * i * (1.0f - i)));
    Put(zr + g + j, dcj * (Get(cp + j, u) * f * (1.0f - f)));
    Put(zr + 2 * g + j, dcj * (i * (1.0f - gg * gg)));
    Put(zr + 3 * g + j, dhj * (tc * o * (1.0f - o)));
    Put(dcr + j, dcj * f);
  });
}

// Forward: gates (which may be x_proj's buffer) = act(x_proj + h W), then
// c, h; writes ys, the final (h, c) and, when keep, every c_t. unit_parts >
// 1: each stripe's hidden units split over that many threads, in lockstep
// (ForwardUnits); else whole stripes or batch rows a thread.
void ForwardUnits(const Shape& d, int parts, ffi::ThreadPool* pool,
                  bool keep, const float* x_proj, const float* h0,
                  const float* c0, const float* w_h, float* ys, float* h_out,
                  float* c_out, float* cs, float* gates);

// A grouped layer's input projection inside the forward loop: a step's
// gates start from bias + x_t W_x (stripe s's inputs x [S, T, B, I/S],
// w_x [S, I/S, 4G], bias [S, 4G]) instead of a projected window.
struct Projection {
  const float* x;
  const float* w_x;
  const float* bias;
  int width;  // I/S
};

void Forward(const Shape& d, int threads, int unit_parts,
             ffi::ThreadPool* pool, bool keep, const float* x_proj,
             const float* h0, const float* c0, const float* w_h, float* ys,
             float* h_out, float* c_out, float* cs, float* gates,
             const Projection* proj = nullptr) {
  const int g = int(d.g), k4 = 4 * g;
  if (!proj && d.b > 0 && UnitParts(g, unit_parts) > 1)
    return ForwardUnits(d, UnitParts(g, unit_parts), pool, keep, x_proj, h0,
                        c0, w_h, ys, h_out, c_out, cs, gates);
  const Packed packed(d, g, k4, w_h, {{0, k4}});
  const int xw = proj ? proj->width : 0;
  const Packed packed_x(proj ? d : Shape{0, 0, 0, 0}, xw, k4,
                        proj ? proj->w_x : nullptr, {{0, k4}});
  Run(Plan(int(d.s), int(d.b), threads), pool, [&](const Task& task) {
    const int s = task.stripe, n = task.rows;
    const int64_t state0 = (int64_t(s) * d.b + task.row0) * g;
    // The carry lives in the results' rows (no allocation per call).
    float* h = h_out + state0;
    float* c = c_out + state0;
    std::copy(h0 + state0, h0 + state0 + int64_t(n) * g, h);
    std::copy(c0 + state0, c0 + state0 + int64_t(n) * g, c);
    const float* w = w_h + int64_t(s) * g * k4;
    for (int64_t t = 0; t < d.t; ++t) {
      const int64_t row = (int64_t(s) * d.t + t) * d.b + task.row0;
      float* z = gates + row * k4;
      if (proj) {  // z = bias + x_t W_x + h W_h
        const float* xt = proj->x + row * xw;
        const float* wx = proj->w_x + int64_t(s) * xw * k4;
        const float* bias = proj->bias + int64_t(s) * k4;
        if (d.b == 1) {
          RowTimesMatrix(k4, xw, xt, wx, k4, bias, z);
          RowTimesMatrix(k4, g, h, w, k4, z, z);
        } else {
          Matmul(n, k4, std::array<Product, 2>{{
                     {{xw, xt, xw, wx, k4}, packed_x.Panels(s, 0)},
                     {{g, h, g, w, k4}, packed.Panels(s, 0)}}},
                 bias, 0, z, k4);
        }
      } else if (d.b == 1) {  // whatever the threads: every row sums alike
        RowTimesMatrix(k4, g, h, w, k4, x_proj + row * k4, z);
      } else {
        Matmul(n, k4, g, h, g, w, k4, packed.Panels(s, 0), x_proj + row * k4,
               k4, z, k4);
      }
      for (int r = 0; r < n; ++r) {
        float* zr = z + int64_t(r) * k4;
        Activate(zr, g, 0, g);
        Cell(zr, g, 0, g, c + int64_t(r) * g, h + int64_t(r) * g,
             ys + (row + r) * g, keep ? cs + (row + r) * g : nullptr);
      }
    }
  });
}

// Dense layers on more threads than stripes: each thread owns some hidden
// units of a stripe (its four gates' columns of W, every batch row) rather
// than some rows (each thread then reads all of W every step: at dense
// S=1, hidden 512, 4 MB a step from the shared cache; at batch 1, where a
// step is W read once, one thread read it all). A step needs all of
// h_{t-1}, so the parts move step by step (Lockstep). h_{t-1} is read from
// ys; c stays in c_out, each part updating its units.
void ForwardUnits(const Shape& d, int parts, ffi::ThreadPool* pool,
                  bool keep, const float* x_proj, const float* h0,
                  const float* c0, const float* w_h, float* ys, float* h_out,
                  float* c_out, float* cs, float* gates) {
  const int g = int(d.g), k4 = 4 * g, b = int(d.b);
  std::vector<std::pair<int, int>> ranges;
  for (int p = 0; p < parts; ++p)
    for (int q = 0; q < 4; ++q) {
      const auto [u0, u1] = Units(g, parts, p);
      ranges.push_back({q * g + u0, q * g + u1});
    }
  const Packed packed(d, g, k4, w_h, ranges);
  std::copy(c0, c0 + d.s * d.b * g, c_out);
  RunLockstep(int(d.s) * parts, d.t, pool, [&](int part, int64_t t) {
    const int s = part / parts, p = part % parts;
    const auto [u0, u1] = Units(g, parts, p);
    const int64_t row = (int64_t(s) * d.t + t) * d.b;
    const float* h = t ? ys + (row - d.b) * g : h0 + int64_t(s) * d.b * g;
    for (int q = 0; q < 4; ++q) {
      const int64_t j = q * g + u0;
      const float* w = w_h + int64_t(s) * g * k4 + j;
      if (b == 1)
        RowTimesMatrix(u1 - u0, g, h, w, k4, x_proj + row * k4 + j,
                       gates + row * k4 + j);
      else
        Matmul(b, u1 - u0, g, h, g, w, k4,
               packed.Panels(s, size_t(p) * 4 + q), x_proj + row * k4 + j,
               k4, gates + row * k4 + j, k4);
    }
    for (int r = 0; r < b; ++r) {
      float* zr = gates + (row + r) * k4;
      Activate(zr, g, u0, u1);
      Cell(zr, g, u0, u1, c_out + (int64_t(s) * d.b + r) * g, nullptr,
           ys + (row + r) * g, keep ? cs + (row + r) * g : nullptr);
    }
  });
  for (int64_t s = 0; s < d.s; ++s) {
    const float* last = d.t ? ys + ((s * d.t + d.t - 1) * d.b) * g
                            : h0 + s * d.b * g;
    std::copy(last, last + d.b * g, h_out + s * d.b * g);
  }
}

// The window's weight gradients from its pre-activation gradients dz
// [S, T, B, 4G]: per stripe s, over its T*B rows q (time-major, as dz's),
//   d_w_h[s] = h_prevᵀ dz[s]   h_prev row q: h0[s] for q < B, else ys[s] row
//                               q - B (h_{t-1} is the previous step's output)
//   d_w_x    = xᵀ dz[s]        grouped: x[s] [T*B, I/S] into d_w_x[s];
//                               dense: x [T*B, I] into d_w_x[:, s, :]
//   d_bias[s] = the sum of dz[s]'s rows.
// Why here: XLA's CPU backend runs these contractions over the rows as its
// own (Eigen) dots (its matmul library takes the form only transposed, and
// was slower still): for lab.bench's grouped S=8 layer (T=64, B=32, G=64)
// the two dots and the sum took 9.8 ms, 109 GFLOP/s, against 7.3 ms, 148
// GFLOP/s here (2-core AMD EPYC with AVX-512). Small stripes only: large
// ones are faster as XLA's (native.py, SMALL_STRIPE_FLOATS). Rows come
// in chunks (StripeGrads), in the order the backward loop writes them,
// which sums them inside the loop where it can (Backward). Threads split
// the stripes' columns in whole panels; every element sums its rows in
// one order, so any split gives the same bits.
constexpr int kGradChunk = 64;  // rows a chunk: dz's panels stay in L2

// One stripe's columns [first * kPanel, last * kPanel) of its gradients.
struct PanelTask { int stripe, first, last; };

// Where a window's weight gradients go, and what they are made of.
struct GradArgs {
  const float* ys;
  const float* h0;
  const float* x;
  int64_t x_width;  // I/S (grouped) or I (dense)
  bool dense;
  float* d_w_h;
  float* d_w_x;
  float* d_bias;
};

// One stripe's weight gradients, its columns [c0, c1), summed into outputs
// that Zero has cleared, a chunk of rows at a time (Step): a chunk's dz
// columns packed into panels, its h_prev and x rows transposed, then the
// time loops' register blocks.
class StripeGrads {
 public:
  StripeGrads(const Shape& d, const GradArgs& a, const float* dz, int s,
              int c0, int c1)
      : b_(d.b), rows_(d.t * d.b), s_(s), g_(int(d.g)), k4_(4 * g_),
        xw_(int(a.x_width)), n_(c1 - c0),
        ldx_(a.dense ? d.s * k4_ : k4_),
        dzs_(dz + int64_t(s) * rows_ * k4_ + c0),
        ys_(a.ys), h0_(a.h0),
        xs_(a.x + (a.dense ? 0 : int64_t(s) * rows_ * xw_)),
        wh_(a.d_w_h + int64_t(s) * g_ * k4_ + c0),
        wx_(a.d_w_x + (a.dense ? int64_t(s) * k4_ : int64_t(s) * xw_ * k4_) +
            c0),
        db_(a.d_bias + int64_t(s) * k4_ + c0),
        packed_(size_t(kGradChunk) * n_),
        at_(size_t(kGradChunk) * std::max(g_, xw_)) {}

  void Zero() {
    std::fill(db_, db_ + n_, 0.0f);
    for (int i = 0; i < g_; ++i)
      std::fill(wh_ + i * k4_, wh_ + i * k4_ + n_, 0.0f);
    for (int i = 0; i < xw_; ++i)
      std::fill(wx_ + i * ldx_, wx_ + i * ldx_ + n_, 0.0f);
  }

  // After time step t's rows (the window's steps come from its end back,
  // as the backward loop writes them): the rows since the last sum once
  // they make a chunk, or at step 0. The same order wherever it runs, so
  // the same bits from the loop and from WeightGrads.
  void Step(int64_t t) {
    const int64_t q0 = t * b_;
    if (pending_ - q0 < kGradChunk && t > 0) return;
    for (int64_t q = q0; q < pending_; q += kGradChunk)
      Chunk(q, int(std::min<int64_t>(kGradChunk, pending_ - q)));
    pending_ = q0;
  }

 private:
  void Chunk(int64_t q0, int kc) {
    const float* dz = dzs_ + q0 * k4_;
    // dz's chunk, these columns: whole panels packed [kc, kPanel] one
    // after another, then any last partial panel [kc, rest].
    for (int j = 0; j < n_; j += kPanel) {
      const int w = std::min(kPanel, n_ - j);
      for (int k = 0; k < kc; ++k)
        std::copy(dz + Index(k) * k4_ + j, dz + Index(k) * k4_ + j + w,
                  packed_.data() + Index(j) * kc + Index(k) * w);
    }
    Lanes(n_, [&](int j, auto u) {  // the bias: rows in order
      auto sum = Get(db_ + j, u);
      for (int k = 0; k < kc; ++k)
        sum = sum + Get(dz + Index(k) * k4_ + j, u);
      Put(db_ + j, sum);
    });
    const int64_t b = b_, s = s_;
    Accumulate(q0, kc, g_, [&](int64_t q) {
      return q < b ? h0_ + (s * b + q) * g_
                   : ys_ + (s * rows_ + q - b) * g_;
    }, wh_, k4_);
    Accumulate(q0, kc, xw_, [&](int64_t q) { return xs_ + q * xw_; }, wx_,
               ldx_);
  }

  // C[m, n] += A's rows q0.. transposed [m, kc] times the packed chunk.
  template <typename RowOf>
  void Accumulate(int64_t q0, int kc, int m, RowOf row_of, float* c,
                  Index ldc) {
    float* at = at_.data();
    for (int k = 0; k < kc; ++k) {
      const float* a = row_of(q0 + k);
      for (int i = 0; i < m; ++i) at[size_t(i) * kc + k] = a[i];
    }
    for (int j = 0; j < n_; j += kPanel) {
      const int w = std::min(kPanel, n_ - j);
      const float* pw = packed_.data() + Index(j) * kc;
      if (w == kPanel) {
        Columns<kVectors>(m, kc, at, kc, pw, kPanel, c + j, ldc, c + j, ldc);
        continue;
      }
      int v = 0;
      for (; v + kLanes <= w; v += kLanes)
        Columns<1>(m, kc, at, kc, pw + v, w, c + j + v, ldc, c + j + v, ldc);
      for (; v < w; ++v)
        for (int i = 0; i < m; ++i) {
          float sum = c[i * ldc + j + v];
          for (int k = 0; k < kc; ++k)
            sum += at[size_t(i) * kc + k] * pw[Index(k) * w + v];
          c[i * ldc + j + v] = sum;
        }
    }
  }

  const int64_t b_, rows_;  // rows_ = T * B
  const int s_, g_, k4_, xw_, n_;
  const Index ldx_;
  const float* dzs_;
  const float* ys_;
  const float* h0_;
  const float* xs_;
  float* wh_;
  float* wx_;
  float* db_;
  std::vector<float> packed_, at_;
  int64_t pending_ = rows_;  // rows [t * B, pending_) are not summed yet
};

void WeightGrads(const Shape& d, int threads, ffi::ThreadPool* pool,
                 const float* dz, const GradArgs& a) {
  const int k4 = int(4 * d.g);
  const int panels = (k4 + kPanel - 1) / kPanel;
  // Column parts per stripe: enough for every thread, in whole panels.
  const int parts = int(std::max<int64_t>(
      1, std::min<int64_t>(panels, (threads + d.s - 1) / std::max<int64_t>(
                                                          d.s, 1))));
  std::vector<PanelTask> tasks;
  for (int s = 0; s < d.s; ++s)
    for (int p = 0; p < parts; ++p) {
      const int first = int(int64_t(panels) * p / parts);
      const int last = int(int64_t(panels) * (p + 1) / parts);
      if (last > first) tasks.push_back({s, first, last});
    }
  Run(Spread(tasks, threads), pool, [&](const PanelTask& task) {
    StripeGrads grads(d, a, dz, task.stripe, task.first * kPanel,
                      std::min(k4, task.last * kPanel));
    grads.Zero();
    for (int64_t t = d.t - 1; t >= 0; --t) grads.Step(t);
  });
}

// Backward: the reverse loop carries (dh, dc); per step the pre-activation
// gradients dz_t (written over the gates, which may share dz's buffer) and
// dh_{t-1} = dz_t W^T. W^T comes transposed by the caller, one copy that
// every thread reads: a copy per thread cost about 5 ms a call at dense
// S=1 (what made the reverse loop slower than the forward one) and doubled
// what the threads read from the shared cache each step. unit_parts as
// Forward's.
void BackwardUnits(const Shape& d, int parts, ffi::ThreadPool* pool,
                   const float* d_ys, const float* gates, const float* cs,
                   const float* c0, const float* w_t, const float* dh_last,
                   const float* dc_last, float* dz, float* dh0, float* dc0);

// With `grads`, Backward gives the window's weight gradients too
// (WeightGrads' results). Where each thread runs whole stripes they are
// summed inside the loop, each chunk of a stripe's dz as soon as it is
// written, still in cache (WeightGrads' first read of dz from memory had
// taken a sixth of its time); else WeightGrads runs after the loop. The
// step of lab.bench's core grouped S=8 ran 1.03-1.04x faster.
void Backward(const Shape& d, int threads, int unit_parts,
              ffi::ThreadPool* pool, const float* d_ys, const float* gates,
              const float* cs, const float* c0, const float* w_t,
              const float* dh_last, const float* dc_last, float* dz,
              float* dh0, float* dc0, const GradArgs* grads = nullptr) {
  const int g = int(d.g), k4 = 4 * g;
  const auto plan = Plan(int(d.s), int(d.b), threads);
  const bool whole_stripes =
      !plan.empty() && std::all_of(plan.begin(), plan.end(), [&](auto& p) {
        return std::all_of(p.begin(), p.end(),
                           [&](const Task& t) { return t.rows == d.b; });
      });
  if (d.b > 0 && UnitParts(g, unit_parts) > 1) {
    BackwardUnits(d, UnitParts(g, unit_parts), pool, d_ys, gates, cs, c0, w_t,
                  dh_last, dc_last, dz, dh0, dc0);
  } else {
    const Packed packed(d, k4, g, w_t, {{0, g}});
    const bool in_loop = grads && whole_stripes;
    Run(plan, pool, [&](const Task& task) {
      const int s = task.stripe, n = task.rows;
      std::optional<StripeGrads> sums;
      if (in_loop) {
        sums.emplace(d, *grads, dz, s, 0, k4);
        sums->Zero();
      }
      const int64_t state0 = (int64_t(s) * d.b + task.row0) * g;
      float* dh = dh0 + state0;
      float* dc = dc0 + state0;
      std::copy(dh_last + state0, dh_last + state0 + int64_t(n) * g, dh);
      std::copy(dc_last + state0, dc_last + state0 + int64_t(n) * g, dc);
      const float* wt = w_t + int64_t(s) * k4 * g;
      for (int64_t t = d.t - 1; t >= 0; --t) {
        const int64_t row = (int64_t(s) * d.t + t) * d.b + task.row0;
        for (int r = 0; r < n; ++r) {
          const float* cp =
              t ? cs + (row - d.b + r) * g : c0 + state0 + int64_t(r) * g;
          CellBack(gates + (row + r) * k4, cs + (row + r) * g, cp,
                   d_ys + (row + r) * g, dh + int64_t(r) * g,
                   dc + int64_t(r) * g, dz + (row + r) * k4, g, 0, g);
        }
        if (d.b == 1)
          RowTimesMatrix(g, k4, dz + row * k4, wt, g, nullptr, dh);
        else
          Matmul(n, g, k4, dz + row * k4, k4, wt, g, packed.Panels(s, 0),
                 nullptr, 0, dh, g);
        if (sums) sums->Step(t);
      }
    });
    if (in_loop) return;
  }
  if (grads) WeightGrads(d, threads, pool, dz, *grads);
}

// Forward's split by hidden units, backward: phase i (0..T) runs step t =
// T - 1 - i; each part first gets its units of dh_t = dz_{t+1} W^T (all of
// dz_{t+1}: the step before), then its units' dz_t. Phase T is that matmul
// alone: dh0.
void BackwardUnits(const Shape& d, int parts, ffi::ThreadPool* pool,
                   const float* d_ys, const float* gates, const float* cs,
                   const float* c0, const float* w_t, const float* dh_last,
                   const float* dc_last, float* dz, float* dh0, float* dc0) {
  const int g = int(d.g), k4 = 4 * g, b = int(d.b);
  std::vector<std::pair<int, int>> ranges;
  for (int p = 0; p < parts; ++p) ranges.push_back(Units(g, parts, p));
  const Packed packed(d, k4, g, w_t, ranges);
  std::copy(dc_last, dc_last + d.s * d.b * g, dc0);
  RunLockstep(int(d.s) * parts, d.t + 1, pool, [&](int part, int64_t i) {
    const int s = part / parts, p = part % parts;
    const auto [u0, u1] = Units(g, parts, p);
    const int64_t t = d.t - 1 - i, state0 = int64_t(s) * d.b * g;
    float* dh = dh0 + state0;
    if (i == 0) {
      for (int r = 0; r < b; ++r)
        std::copy(dh_last + state0 + int64_t(r) * g + u0,
                  dh_last + state0 + int64_t(r) * g + u1,
                  dh + int64_t(r) * g + u0);
    } else {
      const int64_t next = (int64_t(s) * d.t + t + 1) * d.b;
      const float* w = w_t + int64_t(s) * k4 * g + u0;
      if (b == 1)
        RowTimesMatrix(u1 - u0, k4, dz + next * k4, w, g, nullptr, dh + u0);
      else
        Matmul(b, u1 - u0, k4, dz + next * k4, k4, w, g, packed.Panels(s, p),
               nullptr, 0, dh + u0, g);
    }
    if (t < 0) return;
    const int64_t row = (int64_t(s) * d.t + t) * d.b;
    for (int r = 0; r < b; ++r) {
      const float* cp =
          t ? cs + (row - d.b + r) * g : c0 + state0 + int64_t(r) * g;
      CellBack(gates + (row + r) * k4, cs + (row + r) * g, cp,
               d_ys + (row + r) * g, dh + int64_t(r) * g,
               dc0 + state0 + int64_t(r) * g, dz + (row + r) * k4, g, u0, u1);
    }
  });
}

// "name is [a, b, c], expected [x, y, z]" unless `buffer`'s shape is `want`.
template <typename B>
std::string Mismatch(const char* name, const B& buffer,
                     std::initializer_list<int64_t> want) {
  const auto dims = buffer.dimensions();
  if (dims.size() == want.size() &&
      std::equal(want.begin(), want.end(), dims.begin()))
    return "";
  auto list = [](auto begin, auto end) {
    std::string s = "[";
    for (auto it = begin; it != end; ++it)
      s += (it == begin ? "" : ", ") + std::to_string(*it);
    return s + "]";
  };
  return std::string(name) + " is " + list(dims.begin(), dims.end()) +
         ", expected " + list(want.begin(), want.end());
}

// The window's shape from a [S, T, B, 4G] buffer, or why it is not one.
std::string WindowShape(const char* name,
                        const ffi::AnyBuffer::Dimensions& dims, Shape* d) {
  if (dims.size() != 4 || dims[3] % 4)
    return std::string(name) + " must be [S, T, B, 4G]";
  for (int64_t n : dims)
    if (n < 0 || n > INT_MAX)
      return std::string(name) + ": a dimension out of range";
  *d = {dims[0], dims[1], dims[2], dims[3] / 4};
  // Lanes() and the column loops count within a row in int: 4G x G must fit.
  if (d->g * 4 * d->g > INT_MAX)
    return std::string(name) + ": stripe width " + std::to_string(d->g) +
           " too large";
  return "";
}

ffi::Error Failed(const std::string& why) {
  return ffi::Error::InvalidArgument(why);
}

// A C++ exception (a failed allocation, a thread that cannot start) as an
// XLA error, never an abort.
template <typename F>
ffi::Error Guarded(const char* what, F&& body) {
  try {
    body();
    return ffi::Error::Success();
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string(what) + ": " + e.what());
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string(what) + ": unknown C++ exception");
  }
}

// A forward call's checks of h0, c0, w_h and its results' sizes.
std::vector<std::string> ForwardMismatches(
    const Shape& d, bool keep, const ffi::Buffer<ffi::F32>& h0,
    const ffi::Buffer<ffi::F32>& c0, const ffi::Buffer<ffi::F32>& w_h,
    ffi::ResultBuffer<ffi::F32>& ys, ffi::ResultBuffer<ffi::F32>& h,
    ffi::ResultBuffer<ffi::F32>& c, ffi::ResultBuffer<ffi::F32>& cs,
    ffi::ResultBuffer<ffi::F32>& gates) {
  return {Mismatch("h0", h0, {d.s, d.b, d.g}),
          Mismatch("c0", c0, {d.s, d.b, d.g}),
          Mismatch("w_h", w_h, {d.s, d.g, 4 * d.g}),
          Mismatch("ys", *ys, {d.s, d.t, d.b, d.g}),
          Mismatch("h", *h, {d.s, d.b, d.g}),
          Mismatch("c", *c, {d.s, d.b, d.g}),
          keep ? Mismatch("cs", *cs, {d.s, d.t, d.b, d.g}) : std::string(),
          Mismatch("gates", *gates, {d.s, d.t, d.b, 4 * d.g})};
}

// The first failed check (a shape that could not be read comes first).
std::string FirstMismatch(const std::string& why,
                          const std::vector<std::string>& checks) {
  if (!why.empty()) return why;
  for (const std::string& m : checks)
    if (!m.empty()) return m;
  return "";
}

// A thread count from an attribute, within reason.
int Clipped(int64_t n) { return int(std::min<int64_t>(n, 1 << 16)); }

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_proj,
                       ffi::Buffer<ffi::F32> h0, ffi::Buffer<ffi::F32> c0,
                       ffi::Buffer<ffi::F32> w_h,
                       ffi::ResultBuffer<ffi::F32> ys,
                       ffi::ResultBuffer<ffi::F32> h,
                       ffi::ResultBuffer<ffi::F32> c,
                       ffi::ResultBuffer<ffi::F32> cs,
                       ffi::ResultBuffer<ffi::F32> gates, int64_t threads,
                       int64_t unit_parts) {
  Shape d;
  std::string why = WindowShape("x_proj", x_proj.dimensions(), &d);
  const bool keep = cs->element_count() > 0;
  const std::string m = FirstMismatch(
      why, ForwardMismatches(d, keep, h0, c0, w_h, ys, h, c, cs, gates));
  if (!m.empty()) return Failed("zebra_native_forward: " + m);
  return Guarded("zebra_native_forward", [&] {
    Forward(d, Clipped(threads), Clipped(unit_parts), &pool, keep,
            x_proj.typed_data(), h0.typed_data(), c0.typed_data(),
            w_h.typed_data(), ys->typed_data(), h->typed_data(),
            c->typed_data(), keep ? cs->typed_data() : nullptr,
            gates->typed_data());
  });
}

ffi::Error ForwardProjectedImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w_x,
    ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> h0,
    ffi::Buffer<ffi::F32> c0, ffi::Buffer<ffi::F32> w_h,
    ffi::ResultBuffer<ffi::F32> ys, ffi::ResultBuffer<ffi::F32> h,
    ffi::ResultBuffer<ffi::F32> c, ffi::ResultBuffer<ffi::F32> cs,
    ffi::ResultBuffer<ffi::F32> gates, int64_t threads) {
  Shape d;
  std::string why = WindowShape("gates", gates->dimensions(), &d);
  const auto xd = x.dimensions();
  const int64_t width = xd.size() == 4 ? xd[3] : -1;
  if (why.empty() && (width < 0 || width > INT_MAX))
    why = "x must be [S, T, B, I/S]";
  const bool keep = cs->element_count() > 0;
  std::vector<std::string> checks = {
      Mismatch("x", x, {d.s, d.t, d.b, width}),
      Mismatch("w_x", w_x, {d.s, width, 4 * d.g}),
      Mismatch("bias", bias, {d.s, 4 * d.g})};
  for (std::string& m :
       ForwardMismatches(d, keep, h0, c0, w_h, ys, h, c, cs, gates))
    checks.push_back(std::move(m));
  const std::string m = FirstMismatch(why, checks);
  if (!m.empty()) return Failed("zebra_native_forward_projected: " + m);
  const Projection proj{x.typed_data(), w_x.typed_data(), bias.typed_data(),
                        int(width)};
  return Guarded("zebra_native_forward_projected", [&] {
    Forward(d, Clipped(threads), 1, &pool, keep,
            nullptr, h0.typed_data(), c0.typed_data(), w_h.typed_data(),
            ys->typed_data(), h->typed_data(), c->typed_data(),
            keep ? cs->typed_data() : nullptr, gates->typed_data(), &proj);
  });
}

// A backward call's checks of its inputs and results.
std::vector<std::string> BackwardMismatches(
    const Shape& d, const ffi::Buffer<ffi::F32>& d_ys,
    const ffi::Buffer<ffi::F32>& cs, const ffi::Buffer<ffi::F32>& c0,
    const ffi::Buffer<ffi::F32>& w_t, const ffi::Buffer<ffi::F32>& dh_last,
    const ffi::Buffer<ffi::F32>& dc_last, ffi::ResultBuffer<ffi::F32>& dz,
    ffi::ResultBuffer<ffi::F32>& dh0, ffi::ResultBuffer<ffi::F32>& dc0) {
  return {Mismatch("d_ys", d_ys, {d.s, d.t, d.b, d.g}),
          Mismatch("cs", cs, {d.s, d.t, d.b, d.g}),
          Mismatch("c0", c0, {d.s, d.b, d.g}),
          Mismatch("w_h^T", w_t, {d.s, 4 * d.g, d.g}),
          Mismatch("dh", dh_last, {d.s, d.b, d.g}),
          Mismatch("dc", dc_last, {d.s, d.b, d.g}),
          Mismatch("dz", *dz, {d.s, d.t, d.b, 4 * d.g}),
          Mismatch("dh0", *dh0, {d.s, d.b, d.g}),
          Mismatch("dc0", *dc0, {d.s, d.b, d.g})};
}

// The weight gradients' checks of ys, h0, x and their results; x's last
// dimension into *width, whether it is dense into *dense.
std::vector<std::string> GradMismatches(
    const Shape& w, const ffi::Buffer<ffi::F32>& ys,
    const ffi::Buffer<ffi::F32>& h0, const ffi::Buffer<ffi::F32>& x,
    ffi::ResultBuffer<ffi::F32>& d_w_h, ffi::ResultBuffer<ffi::F32>& d_w_x,
    ffi::ResultBuffer<ffi::F32>& d_bias, int64_t* width, bool* dense) {
  const auto xd = x.dimensions();
  *dense = xd.size() == 3;
  *width = xd.size() ? xd[xd.size() - 1] : 0;
  std::string why;
  if (xd.size() != 3 && xd.size() != 4)
    why = "x must be [T, B, I] (dense) or [S, T, B, I/S] (grouped)";
  else if (*width < 0 || *width > INT_MAX)
    why = "x: a dimension out of range";
  if (!why.empty()) return {why};
  return {Mismatch("ys", ys, {w.s, w.t, w.b, w.g}),
          Mismatch("h0", h0, {w.s, w.b, w.g}),
          *dense ? Mismatch("x", x, {w.t, w.b, *width})
                 : Mismatch("x", x, {w.s, w.t, w.b, *width}),
          Mismatch("d_w_h", *d_w_h, {w.s, w.g, 4 * w.g}),
          *dense ? Mismatch("d_w_x", *d_w_x, {*width, w.s, 4 * w.g})
                 : Mismatch("d_w_x", *d_w_x, {w.s, *width, 4 * w.g}),
          Mismatch("d_bias", *d_bias, {w.s, 4 * w.g})};
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> d_ys,
                        ffi::Buffer<ffi::F32> gates, ffi::Buffer<ffi::F32> cs,
                        ffi::Buffer<ffi::F32> c0, ffi::Buffer<ffi::F32> w_t,
                        ffi::Buffer<ffi::F32> dh_last,
                        ffi::Buffer<ffi::F32> dc_last,
                        ffi::ResultBuffer<ffi::F32> dz,
                        ffi::ResultBuffer<ffi::F32> dh0,
                        ffi::ResultBuffer<ffi::F32> dc0, int64_t threads,
                        int64_t unit_parts) {
  Shape d;
  const std::string why = WindowShape("gates", gates.dimensions(), &d);
  const std::string m = FirstMismatch(
      why, why.empty() ? BackwardMismatches(d, d_ys, cs, c0, w_t, dh_last,
                                            dc_last, dz, dh0, dc0)
                       : std::vector<std::string>{});
  if (!m.empty()) return Failed("zebra_native_backward: " + m);
  return Guarded("zebra_native_backward", [&] {
    Backward(d, Clipped(threads), Clipped(unit_parts), &pool,
             d_ys.typed_data(), gates.typed_data(), cs.typed_data(),
             c0.typed_data(), w_t.typed_data(), dh_last.typed_data(),
             dc_last.typed_data(), dz->typed_data(), dh0->typed_data(),
             dc0->typed_data());
  });
}

// The backward pass and the window's weight gradients in one call.
ffi::Error BackwardGradsImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> d_ys,
    ffi::Buffer<ffi::F32> gates, ffi::Buffer<ffi::F32> cs,
    ffi::Buffer<ffi::F32> c0, ffi::Buffer<ffi::F32> w_t,
    ffi::Buffer<ffi::F32> dh_last, ffi::Buffer<ffi::F32> dc_last,
    ffi::Buffer<ffi::F32> ys, ffi::Buffer<ffi::F32> h0,
    ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> dz,
    ffi::ResultBuffer<ffi::F32> dh0, ffi::ResultBuffer<ffi::F32> dc0,
    ffi::ResultBuffer<ffi::F32> d_w_h, ffi::ResultBuffer<ffi::F32> d_w_x,
    ffi::ResultBuffer<ffi::F32> d_bias, int64_t threads,
    int64_t unit_parts) {
  Shape d;
  const std::string why = WindowShape("gates", gates.dimensions(), &d);
  int64_t width = 0;
  bool dense = false;
  std::vector<std::string> checks;
  if (why.empty()) {
    checks = BackwardMismatches(d, d_ys, cs, c0, w_t, dh_last, dc_last, dz,
                                dh0, dc0);
    for (std::string& m : GradMismatches(d, ys, h0, x, d_w_h, d_w_x, d_bias,
                                         &width, &dense))
      checks.push_back(m);
  }
  const std::string m = FirstMismatch(why, checks);
  if (!m.empty()) return Failed("zebra_native_backward_grads: " + m);
  return Guarded("zebra_native_backward_grads", [&] {
    const GradArgs grads{ys.typed_data(),     h0.typed_data(),
                         x.typed_data(),      width,
                         dense,               d_w_h->typed_data(),
                         d_w_x->typed_data(), d_bias->typed_data()};
    Backward(d, Clipped(threads), Clipped(unit_parts), &pool,
             d_ys.typed_data(), gates.typed_data(), cs.typed_data(),
             c0.typed_data(), w_t.typed_data(), dh_last.typed_data(),
             dc_last.typed_data(), dz->typed_data(), dh0->typed_data(),
             dc0->typed_data(), &grads);
  });
}

}  // namespace

// The vector instructions this library was compiled for: what
// native.py reports and its tests check (an x86-64-v3 build must
// not have used AVX-512).
#if defined(__AVX512F__)
#define ZEBRA_NATIVE_ISA "avx512f"
#elif defined(__AVX2__)
#define ZEBRA_NATIVE_ISA "avx2"
#elif defined(__AVX__)
#define ZEBRA_NATIVE_ISA "avx"
#elif defined(__SSE2__)
#define ZEBRA_NATIVE_ISA "sse2"
#elif defined(__ARM_NEON)
#define ZEBRA_NATIVE_ISA "neon"
#else
#define ZEBRA_NATIVE_ISA "generic"
#endif

extern "C" const char* ZebraNativeTarget() { return ZEBRA_NATIVE_ISA; }

// The build's record, read by native.py from the file before it loads the
// library: the source it was built from (native.py passes its digest) and
// the CPU features the compiler was allowed to use anywhere in the code, in
// /proc/cpuinfo's names. A library built for features this CPU lacks would
// die of SIGILL at its first call (or while loading); it is refused instead.
#ifndef ZEBRA_NATIVE_SOURCE
#define ZEBRA_NATIVE_SOURCE "unknown"
#endif
extern "C" __attribute__((used)) const char ZebraNativeBuild[] =
    "zebra-native-build source=" ZEBRA_NATIVE_SOURCE " isa=" ZEBRA_NATIVE_ISA
    " needs="
#if defined(__x86_64__) || defined(__i386__)
#ifdef __SSE2__
    " sse2"
#endif
#ifdef __SSE3__
    " pni"
#endif
#ifdef __SSSE3__
    " ssse3"
#endif
#ifdef __SSE4_1__
    " sse4_1"
#endif
#ifdef __SSE4_2__
    " sse4_2"
#endif
#ifdef __POPCNT__
    " popcnt"
#endif
#ifdef __AVX__
    " avx"
#endif
#ifdef __AVX2__
    " avx2"
#endif
#ifdef __FMA__
    " fma"
#endif
#ifdef __F16C__
    " f16c"
#endif
#ifdef __BMI__
    " bmi1"
#endif
#ifdef __BMI2__
    " bmi2"
#endif
#ifdef __MOVBE__
    " movbe"
#endif
#ifdef __AVX512F__
    " avx512f"
#endif
#ifdef __AVX512CD__
    " avx512cd"
#endif
#ifdef __AVX512BW__
    " avx512bw"
#endif
#ifdef __AVX512DQ__
    " avx512dq"
#endif
#ifdef __AVX512VL__
    " avx512vl"
#endif
#ifdef __AVX512IFMA__
    " avx512ifma"
#endif
#ifdef __AVX512VBMI__
    " avx512vbmi"
#endif
#ifdef __AVX512VNNI__
    " avx512_vnni"
#endif
#ifdef __AVX512BF16__
    " avx512_bf16"
#endif
#ifdef __AVX512FP16__
    " avx512_fp16"
#endif
#ifdef __AVXVNNI__
    " avx_vnni"
#endif
#elif defined(__aarch64__)
#ifdef __ARM_NEON
    " asimd"
#endif
#ifdef __ARM_FEATURE_FP16_VECTOR_ARITHMETIC
    " asimdhp"
#endif
#ifdef __ARM_FEATURE_DOTPROD
    " asimddp"
#endif
#ifdef __ARM_FEATURE_SVE
    " sve"
#endif
#ifdef __ARM_FEATURE_SVE2
    " sve2"
#endif
#endif
    ";";

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZebraForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x_proj
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h0
                                  .Arg<ffi::Buffer<ffi::F32>>()  // c0
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_h
                                  .Ret<ffi::Buffer<ffi::F32>>()  // ys
                                  .Ret<ffi::Buffer<ffi::F32>>()  // h
                                  .Ret<ffi::Buffer<ffi::F32>>()  // c
                                  .Ret<ffi::Buffer<ffi::F32>>()  // cs
                                  .Ret<ffi::Buffer<ffi::F32>>()  // gates
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("unit_parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZebraBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // d_ys
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gates
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // c0
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_h^T
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dh_last
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dc_last
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dz
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dh0
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dc0
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("unit_parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZebraForwardProjected, ForwardProjectedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h0
                                  .Arg<ffi::Buffer<ffi::F32>>()  // c0
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_h
                                  .Ret<ffi::Buffer<ffi::F32>>()  // ys
                                  .Ret<ffi::Buffer<ffi::F32>>()  // h
                                  .Ret<ffi::Buffer<ffi::F32>>()  // c
                                  .Ret<ffi::Buffer<ffi::F32>>()  // cs
                                  .Ret<ffi::Buffer<ffi::F32>>()  // gates
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZebraBackwardGrads, BackwardGradsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // d_ys
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gates
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // c0
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_h^T
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dh_last
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dc_last
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ys
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h0
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dz
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dh0
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dc0
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d_w_h
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d_w_x
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d_bias
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("unit_parts"));
