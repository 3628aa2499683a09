// The matmuls of the time loops: register blocks that keep a sum of
// products in registers (Block, Columns), W packed into panels a block
// reads contiguously (Pack, Packed), and one row times W for a batch of one
// (RowTimesMatrix). Each output element sums its products in one fixed
// order, whatever the rows and columns around it: any split of the work
// gives the same bits.
//
// Part of native.cc's one translation unit: an unnamed namespace, as there.

#ifndef ZEBRA_NATIVE_MATMUL_H_
#define ZEBRA_NATIVE_MATMUL_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

// One product of a sum: A[rows, k] W[k, columns], row strides lda and ldw;
// A's element (r, k) at a[r * lda + k * a_step] (a_step > 1: A read
// transposed, as the fused head's d_h reads its chunk of d_logits).
struct Term {
  int k;
  const float* a;
  Index lda;
  const float* w;
  Index ldw;
  Index a_step = 1;
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
        const Vec ak = Splat(t.a[r * t.lda + k * t.a_step]);
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

// c[n] = x + a[k] W[k, n] for a batch of one row (sampling): W read row by
// row, in the order it lies in memory, the sums kept in c (a row of 4G
// floats stays in L1). A register block walks W's columns with the stride
// of a whole row, which the prefetchers follow badly, and a step at B = 1
// is nothing but that one pass over W.
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

// A window [S, T, B, 4G]: S stripes, T time steps, B batch rows, G hidden
// units a stripe.
struct Shape {
  int64_t s, t, b, g;
};

// The columns one register block covers: W is packed by panels this wide.
constexpr int kPanel = kVectors * kLanes;

// Columns [0, n) of W[k, ldw] (row stride ldw) as panels of kPanel
// columns, each panel's k rows one after another: what a register block
// reads is then contiguous. Read in place, a block's rows lie a whole row
// of W apart (8 KB at dense S=1, hidden 512): every k touched a new page,
// where the L2 prefetchers stop, and the recurrent matmul ran far below
// the machine's best. The columns past the last whole panel go into one
// more, zero-padded: a width that is no multiple of the panel (hidden 200)
// still runs in register blocks, not one column at a time.
void Pack(int k_size, int n, const float* w, Index ldw, float* panels) {
  for (int j = 0; j < n; j += kPanel) {
    const int width = std::min(kPanel, n - j);
    for (int k = 0; k < k_size; ++k) {
      float* panel_row = panels + Index(j) * k_size + Index(k) * kPanel;
      std::copy(w + k * ldw + j, w + k * ldw + j + width, panel_row);
      std::fill(panel_row + width, panel_row + kPanel, 0.0f);
    }
  }
}

// Floats Pack writes for n columns of k_size rows.
Index PackedSize(int k_size, int n) {
  return Index((n + kPanel - 1) / kPanel) * kPanel * k_size;
}

// One product of a Matmul: A[rows, k] W[k, n], W row-major with row stride
// ldw, also packed (Pack) in `panels`.
struct Product {
  Term term;
  const float* panels;
};

// C[rows, width] = X + the terms' sum for the last, partial panel: each
// block through a scratch block as wide as V vectors (the panel's padding
// columns computed and dropped), so its columns sum in the order of every
// other column's, whatever part of the panel a call covers.
template <int V, size_t N>
void PartialPanel(int rows, int width, const std::array<Term, N>& terms,
                  const float* x, Index ldx, float* c, Index ldc) {
  float xs[kRows * kPanel], cs[kRows * kPanel];
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int m = std::min(kRows, rows - r0);
    for (int r = 0; x && r < m; ++r) {
      std::copy(x + (r0 + r) * ldx, x + (r0 + r) * ldx + width,
                xs + r * kPanel);
      std::fill(xs + r * kPanel + width, xs + (r + 1) * kPanel, 0.0f);
    }
    Columns<V>(m, FromRow(terms, r0), x ? xs : nullptr, kPanel, cs, kPanel);
    for (int r = 0; r < m; ++r)
      std::copy(cs + r * kPanel, cs + r * kPanel + width,
                c + (r0 + r) * ldc);
  }
}

// PartialPanel with the fewest vectors that cover `width` columns.
template <int V = kVectors, size_t N>
void PartialPanelOf(int rows, int width, const std::array<Term, N>& terms,
                    const float* x, Index ldx, float* c, Index ldc) {
  if constexpr (V > 1) {
    if (width <= (V - 1) * kLanes)
      return PartialPanelOf<V - 1>(rows, width, terms, x, ldx, c, ldc);
  }
  PartialPanel<V>(rows, width, terms, x, ldx, c, ldc);
}

// C[rows, n] = X + the products' sum, in the products' order.
template <size_t N>
void Matmul(int rows, int n, const std::array<Product, N>& products,
            const float* x, Index ldx, float* c, Index ldc) {
  auto terms = [&](int j) {
    std::array<Term, N> t;
    for (size_t i = 0; i < N; ++i) {
      const Term& p = products[i].term;
      t[i] = Term{p.k, p.a, p.lda, products[i].panels + Index(j) * p.k,
                  kPanel, p.a_step};
    }
    return t;
  };
  int j = 0;
  for (; j + kPanel <= n; j += kPanel)
    Columns<kVectors>(rows, terms(j), x ? x + j : nullptr, ldx, c + j, ldc);
  if (j < n)
    PartialPanelOf(rows, n - j, terms(j), x ? x + j : nullptr, ldx, c + j,
                   ldc);
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
// range packed (Pack) after the one before (nothing where a call runs one
// row: RowTimesMatrix reads W in place).
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

}  // namespace

#endif  // ZEBRA_NATIVE_MATMUL_H_
