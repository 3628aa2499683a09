// A window's weight gradients, d_w_h, d_w_x and d_bias, summed from its
// pre-activation gradients dz a chunk of rows at a time, with the time
// loops' register blocks (matmul.h).
//
// Part of native.cc's one translation unit: an unnamed namespace, as there.

#ifndef ZEBRA_NATIVE_WEIGHT_GRADS_H_
#define ZEBRA_NATIVE_WEIGHT_GRADS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "matmul.h"
#include "simd.h"
#include "threads.h"

namespace {

// The window's weight gradients from its pre-activation gradients dz
// [S, T, B, 4G]: per stripe s, over its T*B rows q (time-major, as dz's),
//   d_w_h[s] = h_prevᵀ dz[s]   h_prev row q: h0[s] for q < B, else ys[s] row
//                               q - B (h_{t-1} is the previous step's output)
//   d_w_x    = xᵀ dz[s]        grouped: x[s] [T*B, I/S] into d_w_x[s];
//                               dense: x [T*B, I] into d_w_x[:, s, :]
//   d_bias[s] = the sum of dz[s]'s rows.
// Why here: XLA's CPU backend runs these contractions over the rows as its
// own (Eigen) dots (its matmul library takes the form only transposed, and
// was slower still), well below the machine's matmul speed for small
// stripes, whose panels here stay in cache while the rows pass. Small
// stripes only: large ones are faster as XLA's (native.py,
// SMALL_STRIPE_FLOATS). Rows come in chunks (StripeGrads), in the order
// the backward loop writes them, which sums them inside the loop where it
// can (Backward). Threads split the stripes' columns in whole panels;
// every element sums its rows in one order, so any split gives the same
// bits.
constexpr int kGradChunk = 64;  // rows a chunk: dz's panels stay in L2

// One stripe's columns [first * kPanel, last * kPanel) of its gradients.
struct PanelTask { int stripe, first, last; };

// Where a window's weight gradients go, and what they are made of.
struct WeightGradBuffers {
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
  StripeGrads(const Shape& d, const WeightGradBuffers& a, const float* dz, int s,
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
                 const float* dz, const WeightGradBuffers& a) {
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

}  // namespace

#endif  // ZEBRA_NATIVE_WEIGHT_GRADS_H_
