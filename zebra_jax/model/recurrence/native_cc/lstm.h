// A ZebraLSTM layer's two time loops: Forward (the gates, cell and
// outputs of every step) and Backward (the pre-activation gradients and the
// carried dh, dc; with the window's weight gradients where it can), each a
// pass over the window in which every step is one pass over its rows.
//
// Layouts are scan.py's: stripe-major, row-major, float32.
//   x_proj, gates, dz [S, T, B, 4G]   gates [i | f | g | o] within a stripe
//   ys, cs, d_ys      [S, T, B, G]
//   h0, c0, h, c, dh  [S, B, G]
//   w_h               [S, G, 4G]   (forward)
//   w_t               [S, 4G, G]   (backward: W_h^T, read row by row as the
//                                  forward reads W_h)
//   x                 [S, T, B, I/S] (grouped) or [T, B, I] (dense): the
//                                  layer's inputs, for W_x's gradient
// The matmuls and the cell are exact float32 arithmetic but for tanh
// (simd.h); with a call's `bf16` (Bf16Recurrent) the recurrent matmuls
// take bf16 operands instead, their sums float32. NaN and infinities go through every step as they do through
// the scan's: tanh keeps a NaN (only finite values are clamped), and the
// backward pass multiplies the same factors.
//
// Part of native.cc's one translation unit: an unnamed namespace, as there.

#ifndef ZEBRA_NATIVE_LSTM_H_
#define ZEBRA_NATIVE_LSTM_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "bf16_matmul.h"
#include "matmul.h"
#include "simd.h"
#include "threads.h"
#include "weight_grads.h"

namespace {

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

// The time loops' recurrent products with bf16 operands and float32 sums
// (a call's `bf16`; model.cpu_bf16_recurrence): W's column ranges rounded
// and packed once a call (PackPanels), a step's rows of h (forward) or dz
// (backward) rounded and packed as the step reads them (PackRows), the
// sums on the bf16 units (bf16_matmul.h) started from the step's projected
// inputs. Every element sums its pairs in K's order whatever the split, so
// any thread count gives the same bits, as the float32 loops do. Empty
// (false) in a build without AVX512_BF16, whose calls refuse `bf16`.
class Bf16Recurrent {
 public:
  Bf16Recurrent() = default;
  // Column ranges [first, last) of every stripe's W[k_size, ldw].
  Bf16Recurrent(const Shape& d, int k_size, int ldw, const float* w,
                const std::vector<std::pair<int, int>>& ranges) {
#ifdef ZEBRA_BF16_MATMUL
    k_ = k_size;
    pairs_ = (k_size + 1) / 2;
    for (const auto& [first, last] : ranges) {
      offsets_.push_back(per_stripe_);
      widths_.push_back(last - first);
      per_stripe_ += (last - first + 15) / 16 * 16 * pairs_;
    }
    panels_.resize(size_t(per_stripe_ * d.s));
    for (int64_t s = 0; s < d.s; ++s)
      for (size_t i = 0; i < ranges.size(); ++i)
        PackPanels(Operand{w + s * k_size * ldw + ranges[i].first, ldw, true},
                   0, (widths_[i] + 15) / 16, k_size, widths_[i],
                   panels_.data() + s * per_stripe_ + offsets_[i]);
#else
    (void)d, (void)k_size, (void)ldw, (void)w, (void)ranges;
#endif
  }
  explicit operator bool() const { return !panels_.empty(); }

  // A[rows, k_size] (row stride lda) rounded to bf16 pairs in `packed`.
  void PackA(int rows, const float* a, Index lda,
             std::vector<uint32_t>& packed) const {
#ifdef ZEBRA_BF16_MATMUL
    packed.resize(size_t(rows * pairs_));
    PackRows(Operand{a, lda, false}, 0, rows, k_, packed.data());
#else
    (void)rows, (void)a, (void)lda, (void)packed;
#endif
  }

  // C[rows, the range's width] = X + A W (X null: A W; X may be C).
  void Product(int64_t stripe, size_t range, int rows,
               const std::vector<uint32_t>& packed_a, const float* x,
               Index ldx, float* c, Index ldc) const {
#ifdef ZEBRA_BF16_MATMUL
    const int64_t n = widths_[range];
    if (x && x != c)
      for (int r = 0; r < rows; ++r)
        std::copy(x + r * ldx, x + r * ldx + n, c + r * ldc);
    Bf16Panels(rows, packed_a.data(), pairs_,
               panels_.data() + stripe * per_stripe_ + offsets_[range],
               pairs_, n, 0, pairs_, x == nullptr, c, ldc);
#else
    (void)stripe, (void)range, (void)rows, (void)packed_a, (void)x,
        (void)ldx, (void)c, (void)ldc;
#endif
  }

 private:
  int k_ = 0;
  int64_t pairs_ = 0;
  std::vector<uint32_t> panels_;
  std::vector<int64_t> offsets_, widths_;
  int64_t per_stripe_ = 0;
};

// A forward call's buffers, by name (layouts above).
struct ForwardBuffers {
  const float* x_proj;  // the projected inputs; null with a Projection
  const float* h0;
  const float* c0;
  const float* w_h;
  float* ys;
  float* h_out;  // the final h
  float* c_out;  // the final c
  float* cs;     // every c_t, for the backward pass; null: none kept
  float* gates;  // the activated gates; may be x_proj's buffer
  bool bf16 = false;  // the recurrent products in bf16 (Bf16Recurrent)
};

// Forward split by hidden units (below).
void ForwardUnits(const Shape& d, int parts, ffi::ThreadPool* pool,
                  const ForwardBuffers& io);

// A grouped layer's input projection inside the forward loop: a step's
// gates start from bias + x_t W_x (stripe s's inputs x [S, T, B, I/S],
// w_x [S, I/S, 4G], bias [S, 4G]) instead of a projected window.
struct Projection {
  const float* x;
  const float* w_x;
  const float* bias;
  int width;  // I/S
};

// Forward: gates = act(x_proj + h W), then c, h; writes ys, the final
// (h, c) and, where cs is given, every c_t. unit_parts > 1: each stripe's
// hidden units split over that many threads, in lockstep (ForwardUnits);
// else whole stripes or batch rows a thread.
void Forward(const Shape& d, int threads, int unit_parts,
             ffi::ThreadPool* pool, const ForwardBuffers& io,
             const Projection* proj = nullptr) {
  const int g = int(d.g), k4 = 4 * g;
  if (!proj && d.b > 0 && UnitParts(g, unit_parts) > 1)
    return ForwardUnits(d, UnitParts(g, unit_parts), pool, io);
  const Bf16Recurrent bf16 =
      io.bf16 && !proj ? Bf16Recurrent(d, g, k4, io.w_h, {{0, k4}})
                       : Bf16Recurrent();
  const Packed packed(bf16 ? Shape{0, 0, 0, 0} : d, g, k4, io.w_h,
                      {{0, k4}});
  const int xw = proj ? proj->width : 0;
  const Packed packed_x(proj ? d : Shape{0, 0, 0, 0}, xw, k4,
                        proj ? proj->w_x : nullptr, {{0, k4}});
  Run(Plan(int(d.s), int(d.b), threads), pool, [&](const Task& task) {
    const int s = task.stripe, n = task.rows;
    const int64_t state0 = (int64_t(s) * d.b + task.row0) * g;
    // The carry lives in the results' rows (no allocation per call).
    float* h = io.h_out + state0;
    float* c = io.c_out + state0;
    std::copy(io.h0 + state0, io.h0 + state0 + int64_t(n) * g, h);
    std::copy(io.c0 + state0, io.c0 + state0 + int64_t(n) * g, c);
    const float* w = io.w_h + int64_t(s) * g * k4;
    std::vector<uint32_t> h_bf16;
    for (int64_t t = 0; t < d.t; ++t) {
      const int64_t row = (int64_t(s) * d.t + t) * d.b + task.row0;
      float* z = io.gates + row * k4;
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
      } else if (bf16) {
        bf16.PackA(n, h, g, h_bf16);
        bf16.Product(s, 0, n, h_bf16, io.x_proj + row * k4, k4, z, k4);
      } else if (d.b == 1) {  // whatever the threads: every row sums alike
        RowTimesMatrix(k4, g, h, w, k4, io.x_proj + row * k4, z);
      } else {
        Matmul(n, k4, g, h, g, w, k4, packed.Panels(s, 0),
               io.x_proj + row * k4, k4, z, k4);
      }
      for (int r = 0; r < n; ++r) {
        float* zr = z + int64_t(r) * k4;
        Activate(zr, g, 0, g);
        Cell(zr, g, 0, g, c + int64_t(r) * g, h + int64_t(r) * g,
             io.ys + (row + r) * g, io.cs ? io.cs + (row + r) * g : nullptr);
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
                  const ForwardBuffers& io) {
  const int g = int(d.g), k4 = 4 * g, b = int(d.b);
  std::vector<std::pair<int, int>> ranges;
  for (int p = 0; p < parts; ++p)
    for (int q = 0; q < 4; ++q) {
      const auto [u0, u1] = Units(g, parts, p);
      ranges.push_back({q * g + u0, q * g + u1});
    }
  const Bf16Recurrent bf16 =
      io.bf16 ? Bf16Recurrent(d, g, k4, io.w_h, ranges) : Bf16Recurrent();
  const Packed packed(bf16 ? Shape{0, 0, 0, 0} : d, g, k4, io.w_h, ranges);
  std::vector<std::vector<uint32_t>> h_bf16(size_t(d.s * parts));
  std::copy(io.c0, io.c0 + d.s * d.b * g, io.c_out);
  RunLockstep(int(d.s) * parts, d.t, pool, [&](int part, int64_t t) {
    const int s = part / parts, p = part % parts;
    const auto [u0, u1] = Units(g, parts, p);
    const int64_t row = (int64_t(s) * d.t + t) * d.b;
    const float* h =
        t ? io.ys + (row - d.b) * g : io.h0 + int64_t(s) * d.b * g;
    if (bf16) bf16.PackA(b, h, g, h_bf16[size_t(part)]);
    for (int q = 0; q < 4; ++q) {
      const int64_t j = q * g + u0;
      const float* w = io.w_h + int64_t(s) * g * k4 + j;
      if (bf16)
        bf16.Product(s, size_t(p) * 4 + q, b, h_bf16[size_t(part)],
                     io.x_proj + row * k4 + j, k4, io.gates + row * k4 + j,
                     k4);
      else if (b == 1)
        RowTimesMatrix(u1 - u0, g, h, w, k4, io.x_proj + row * k4 + j,
                       io.gates + row * k4 + j);
      else
        Matmul(b, u1 - u0, g, h, g, w, k4,
               packed.Panels(s, size_t(p) * 4 + q), io.x_proj + row * k4 + j,
               k4, io.gates + row * k4 + j, k4);
    }
    for (int r = 0; r < b; ++r) {
      float* zr = io.gates + (row + r) * k4;
      Activate(zr, g, u0, u1);
      Cell(zr, g, u0, u1, io.c_out + (int64_t(s) * d.b + r) * g, nullptr,
           io.ys + (row + r) * g, io.cs ? io.cs + (row + r) * g : nullptr);
    }
  });
  for (int64_t s = 0; s < d.s; ++s) {
    const float* last = d.t ? io.ys + ((s * d.t + d.t - 1) * d.b) * g
                            : io.h0 + s * d.b * g;
    std::copy(last, last + d.b * g, io.h_out + s * d.b * g);
  }
}

// A backward call's buffers, by name (layouts above).
struct BackwardBuffers {
  const float* d_ys;
  const float* gates;  // the forward's activated gates; may be dz's buffer
  const float* cs;
  const float* c0;
  const float* w_t;    // W_h^T
  const float* dh_last;
  const float* dc_last;
  float* dz;
  float* dh0;
  float* dc0;
  bool bf16 = false;  // the recurrent products in bf16 (Bf16Recurrent)
};

// Backward split by hidden units (below).
void BackwardUnits(const Shape& d, int parts, ffi::ThreadPool* pool,
                   const BackwardBuffers& io);

// Backward: the reverse loop carries (dh, dc); per step the pre-activation
// gradients dz_t (written over the gates, which may share dz's buffer) and
// dh_{t-1} = dz_t W^T. W^T comes transposed by the caller, one copy that
// every thread reads: a copy per thread made the reverse loop slower than
// the forward one at dense S=1 and doubled what the threads read from the
// shared cache each step. unit_parts as Forward's.
//
// With `grads`, Backward gives the window's weight gradients too
// (WeightGrads' results). Where each thread runs whole stripes they are
// summed inside the loop, each chunk of a stripe's dz as soon as it is
// written, still in cache (WeightGrads' first read of dz comes from
// memory); else WeightGrads runs after the loop.
void Backward(const Shape& d, int threads, int unit_parts,
              ffi::ThreadPool* pool, const BackwardBuffers& io,
              const WeightGradBuffers* grads = nullptr) {
  const int g = int(d.g), k4 = 4 * g;
  const auto plan = Plan(int(d.s), int(d.b), threads);
  const bool whole_stripes =
      !plan.empty() && std::all_of(plan.begin(), plan.end(), [&](auto& p) {
        return std::all_of(p.begin(), p.end(),
                           [&](const Task& t) { return t.rows == d.b; });
      });
  if (d.b > 0 && UnitParts(g, unit_parts) > 1) {
    BackwardUnits(d, UnitParts(g, unit_parts), pool, io);
  } else {
    const Bf16Recurrent bf16 = io.bf16
                                   ? Bf16Recurrent(d, k4, g, io.w_t, {{0, g}})
                                   : Bf16Recurrent();
    const Packed packed(bf16 ? Shape{0, 0, 0, 0} : d, k4, g, io.w_t,
                        {{0, g}});
    const bool in_loop = grads && whole_stripes;
    Run(plan, pool, [&](const Task& task) {
      const int s = task.stripe, n = task.rows;
      std::optional<StripeGrads> sums;
      if (in_loop) {
        sums.emplace(d, *grads, io.dz, s, 0, k4);
        sums->Zero();
      }
      const int64_t state0 = (int64_t(s) * d.b + task.row0) * g;
      float* dh = io.dh0 + state0;
      float* dc = io.dc0 + state0;
      std::copy(io.dh_last + state0, io.dh_last + state0 + int64_t(n) * g,
                dh);
      std::copy(io.dc_last + state0, io.dc_last + state0 + int64_t(n) * g,
                dc);
      const float* wt = io.w_t + int64_t(s) * k4 * g;
      std::vector<uint32_t> dz_bf16;
      for (int64_t t = d.t - 1; t >= 0; --t) {
        const int64_t row = (int64_t(s) * d.t + t) * d.b + task.row0;
        for (int r = 0; r < n; ++r) {
          const float* cp = t ? io.cs + (row - d.b + r) * g
                              : io.c0 + state0 + int64_t(r) * g;
          CellBack(io.gates + (row + r) * k4, io.cs + (row + r) * g, cp,
                   io.d_ys + (row + r) * g, dh + int64_t(r) * g,
                   dc + int64_t(r) * g, io.dz + (row + r) * k4, g, 0, g);
        }
        if (bf16) {
          bf16.PackA(n, io.dz + row * k4, k4, dz_bf16);
          bf16.Product(s, 0, n, dz_bf16, nullptr, 0, dh, g);
        } else if (d.b == 1)
          RowTimesMatrix(g, k4, io.dz + row * k4, wt, g, nullptr, dh);
        else
          Matmul(n, g, k4, io.dz + row * k4, k4, wt, g, packed.Panels(s, 0),
                 nullptr, 0, dh, g);
        if (sums) sums->Step(t);
      }
    });
    if (in_loop) return;
  }
  if (grads) WeightGrads(d, threads, pool, io.dz, *grads);
}

// Forward's split by hidden units, backward: phase i (0..T) runs step t =
// T - 1 - i; each part first gets its units of dh_t = dz_{t+1} W^T (all of
// dz_{t+1}: the step before), then its units' dz_t. Phase T is that matmul
// alone: dh0.
void BackwardUnits(const Shape& d, int parts, ffi::ThreadPool* pool,
                   const BackwardBuffers& io) {
  const int g = int(d.g), k4 = 4 * g, b = int(d.b);
  std::vector<std::pair<int, int>> ranges;
  for (int p = 0; p < parts; ++p) ranges.push_back(Units(g, parts, p));
  const Bf16Recurrent bf16 =
      io.bf16 ? Bf16Recurrent(d, k4, g, io.w_t, ranges) : Bf16Recurrent();
  const Packed packed(bf16 ? Shape{0, 0, 0, 0} : d, k4, g, io.w_t, ranges);
  std::vector<std::vector<uint32_t>> dz_bf16(size_t(d.s * parts));
  std::copy(io.dc_last, io.dc_last + d.s * d.b * g, io.dc0);
  RunLockstep(int(d.s) * parts, d.t + 1, pool, [&](int part, int64_t i) {
    const int s = part / parts, p = part % parts;
    const auto [u0, u1] = Units(g, parts, p);
    const int64_t t = d.t - 1 - i, state0 = int64_t(s) * d.b * g;
    float* dh = io.dh0 + state0;
    if (i == 0) {
      for (int r = 0; r < b; ++r)
        std::copy(io.dh_last + state0 + int64_t(r) * g + u0,
                  io.dh_last + state0 + int64_t(r) * g + u1,
                  dh + int64_t(r) * g + u0);
    } else {
      const int64_t next = (int64_t(s) * d.t + t + 1) * d.b;
      const float* w = io.w_t + int64_t(s) * k4 * g + u0;
      if (bf16) {
        bf16.PackA(b, io.dz + next * k4, k4, dz_bf16[size_t(part)]);
        bf16.Product(s, size_t(p), b, dz_bf16[size_t(part)], nullptr, 0,
                     dh + u0, g);
      } else if (b == 1)
        RowTimesMatrix(u1 - u0, k4, io.dz + next * k4, w, g, nullptr,
                       dh + u0);
      else
        Matmul(b, u1 - u0, k4, io.dz + next * k4, k4, w, g,
               packed.Panels(s, p), nullptr, 0, dh + u0, g);
    }
    if (t < 0) return;
    const int64_t row = (int64_t(s) * d.t + t) * d.b;
    for (int r = 0; r < b; ++r) {
      const float* cp = t ? io.cs + (row - d.b + r) * g
                          : io.c0 + state0 + int64_t(r) * g;
      CellBack(io.gates + (row + r) * k4, io.cs + (row + r) * g, cp,
               io.d_ys + (row + r) * g, dh + int64_t(r) * g,
               io.dc0 + state0 + int64_t(r) * g, io.dz + (row + r) * k4, g,
               u0, u1);
    }
  });
}

}  // namespace

#endif  // ZEBRA_NATIVE_LSTM_H_
