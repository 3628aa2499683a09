// C[M, N] = op(A) op(B) with bfloat16 operands and float32 sums, on the
// CPU's bf16 dot-product units (AVX512_BF16: vdpbf16ps, two products a
// lane per instruction, where the float32 FMA does one). For the tied
// softmax head's three products (logits = h Eᵀ, d_h = d_logits E,
// d_E = d_logitsᵀ h) and a layer's window products outside its time loop
// (model.cpu_bf16_projections), which XLA's CPU dot runs in float32
// whatever the operands' dtype; and, a step's rows at a time
// (Bf16Panels), the time loops' recurrent products (lstm.h's
// Bf16Recurrent, model.cpu_bf16_recurrence).
//
// The operands are rounded to bf16 (nearest even) as they are packed: A
// by rows, each row's K values in pairs (Kp = K rounded up to even, a zero
// after an odd K); B by panels of 16 columns, each pair of K a row of 32
// bf16 (the 16 columns' two values, interleaved), as vdpbf16ps reads them.
// A row's pair is broadcast, and one instruction adds both products into
// each of 16 columns' sums. Each C element sums its pairs in K's order,
// blocks of K one after another, whatever thread runs its rows: any
// thread count gives the same bits.
//
// Compiled only where the target has AVX512_BF16 (kBf16Matmul); else the
// call reports that the library was built without it (native.py never
// makes that call: it reads the build record first).
//
// Part of native.cc's one translation unit: an unnamed namespace, as there.

#ifndef ZEBRA_NATIVE_BF16_MATMUL_H_
#define ZEBRA_NATIVE_BF16_MATMUL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "threads.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define ZEBRA_BF16_MATMUL 1
#endif

namespace {

#ifdef ZEBRA_BF16_MATMUL
constexpr bool kBf16Matmul = true;

// float32 -> bf16, round to nearest even; a NaN stays a (quiet) NaN.
inline uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// An operand of the product: a row-major float32 [rows, cols] buffer, read
// as it is (element (i, k) of op(X) at x[i * ld + k]) or transposed
// (x[k * ld + i]).
struct Operand {
  const float* x;
  int64_t ld;
  bool transposed;
  float At(int64_t i, int64_t k) const {
    return transposed ? x[k * ld + i] : x[i * ld + k];
  }
};

constexpr int kBf16Rows = 8;      // rows of C a register block holds
constexpr int kBf16Vectors = 2;   // 16-column vectors a block holds
constexpr int kBf16PairsBlock = 512;  // pairs of K per pass over C (L2)
constexpr int kBf16RowChunk = 64;     // rows whose A block stays in L2

// 16 floats -> 16 bf16 (nearest even) in the low halves of 16 uint32 (a
// float32 past `left` read as 0).
inline __m512i Bf16Lanes(const float* x, int64_t left) {
  const __mmask16 mask =
      left >= 16 ? __mmask16(0xffff)
                 : __mmask16((1u << std::max<int64_t>(left, 0)) - 1);
  return _mm512_cvtepu16_epi32(
      __m256i(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x))));
}

// A 16 x 16 tile of uint32 transposed in registers: r[j]'s lane l moves to
// r[l]'s lane j (pairs of 32-bit, then 64-bit, then 128-bit lanes swapped).
inline void Transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0x88);
      t[i + k + 4] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
  }
}

// A's rows [m0, m1) packed: row i's pairs of K, one uint32 each (first
// element in the low half). Stored as it is read, a row's pairs are its
// bf16 values in order; a transposed operand is read in tiles, so neither
// side strides through memory element by element.
void PackRows(const Operand& a, int64_t m0, int64_t m1, int64_t k,
              uint32_t* out) {
  const int64_t pairs = (k + 1) / 2;
  if (!a.transposed) {
    for (int64_t i = m0; i < m1; ++i) {
      const float* row = a.x + i * a.ld;
      uint16_t* dst = reinterpret_cast<uint16_t*>(out + i * pairs);
      int64_t j = 0;
      for (; j + 16 <= k; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                            __m256i(_mm512_cvtneps_pbh(
                                _mm512_loadu_ps(row + j))));
      for (; j < k; ++j) dst[j] = Bf16(row[j]);
      if (k % 2) dst[k] = 0;
    }
    return;
  }
  // Tiles of 16 rows x 16 pairs: each pair's two rows of x (16 of the
  // tile's rows a vector, none read past m1) converted together, the tile
  // transposed in registers and written a row at a time; the pairs past
  // the last whole tile (an odd K's last among them) one value at a time.
  const int64_t whole_pairs = k / 2 / 16 * 16;  // pairs with both halves
  __m512i tile[16];
  for (int64_t i0 = m0; i0 < m1; i0 += 16) {
    const int64_t rows = std::min<int64_t>(16, m1 - i0);
    for (int64_t q0 = 0; q0 < whole_pairs; q0 += 16) {
      for (int j = 0; j < 16; ++j) {
        const float* lo = a.x + 2 * (q0 + j) * a.ld + i0;
        tile[j] = _mm512_or_si512(
            Bf16Lanes(lo, rows),
            _mm512_slli_epi32(Bf16Lanes(lo + a.ld, rows), 16));
      }
      Transpose16(tile);
      for (int l = 0; l < rows; ++l)
        _mm512_storeu_si512(out + (i0 + l) * pairs + q0, tile[l]);
    }
    for (int64_t i = i0; i < i0 + rows; ++i)
      for (int64_t q = whole_pairs; q < pairs; ++q) {
        const uint32_t lo = Bf16(a.At(i, 2 * q));
        const uint32_t hi = 2 * q + 1 < k ? Bf16(a.At(i, 2 * q + 1)) : 0;
        out[i * pairs + q] = lo | (hi << 16);
      }
  }
}

// B's 16-column panels [p0, p1) packed: panel p, pair q is 16 uint32 (the
// column's two K values), zero past N and past an odd K. B read by rows of
// K (transposed: x[k * ld + col]) converts two rows' 16 columns at once;
// else a column's values are a row of x, converted first, then its pairs
// copied into the panel.
void PackPanels(const Operand& b, int64_t p0, int64_t p1, int64_t k,
                int64_t n, uint32_t* out) {
  const int64_t pairs = (k + 1) / 2;
  if (b.transposed) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t q = 0; q < pairs; ++q) {
        const float* first = b.x + 2 * q * b.ld + p * 16;
        const __m512i lo = Bf16Lanes(first, n - p * 16);
        const __m512i hi = 2 * q + 1 < k
                               ? Bf16Lanes(first + b.ld, n - p * 16)
                               : _mm512_setzero_si512();
        _mm512_storeu_si512(out + (p * pairs + q) * 16,
                            _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    return;
  }
  std::vector<uint32_t> row(static_cast<size_t>(pairs));
  for (int64_t p = p0; p < p1; ++p)
    for (int j = 0; j < 16; ++j) {
      const int64_t col = p * 16 + j;
      if (col < n)
        PackRows(Operand{b.x + col * b.ld, b.ld, false}, 0, 1, k, row.data());
      for (int64_t q = 0; q < pairs; ++q)
        out[(p * pairs + q) * 16 + j] = col < n ? row[size_t(q)] : 0;
    }
}

// What a product's last pass over K may do as it stores C: add bias[i] to
// row i, and keep each column's running max (Select(x > max, x, max), so
// NaN is passed over as a scan of the stored values would), both indexed
// from the block's first row and column.
struct Bf16Epilogue {
  const float* bias;  // [rows]
  float* col_max;     // [columns, rounded up to 16]
};

// `e` for the rows from row r on, written to `out` (none stays none).
inline const Bf16Epilogue* RowsFrom(const Bf16Epilogue* e, int64_t r,
                                    Bf16Epilogue& out) {
  if (e == nullptr) return nullptr;
  out = {e->bias + r, e->col_max};
  return &out;
}

// C rows [0, R) x V panels from panel p: pairs [q0, q1) of K added to C
// (first: to zero), columns past N masked off; `epilogue` (if any) applied
// as they are stored. A's rows lie lda pairs apart; B's panels hold
// `pairs` pairs each.
template <int R, int V>
inline void Bf16Block(const uint32_t* a, int64_t lda, int64_t pairs,
                      const uint32_t* b,
                      int64_t q0, int64_t q1, bool first, float* c,
                      int64_t ldc, int64_t col0, int64_t n,
                      const Bf16Epilogue* epilogue = nullptr) {
  __m512 acc[R][V];
  __mmask16 mask[V];
  for (int v = 0; v < V; ++v) {
    const int64_t left = n - (col0 + 16 * v);
    mask[v] = left >= 16 ? __mmask16(0xffff)
                         : __mmask16((1u << std::max<int64_t>(left, 0)) - 1);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = first ? _mm512_setzero_ps()
                        : _mm512_maskz_loadu_ps(mask[v],
                                                c + r * ldc + 16 * v);
  for (int64_t q = q0; q < q1; ++q) {
    __m512i w[V];
    for (int v = 0; v < V; ++v)
      w[v] = _mm512_loadu_si512(b + (v * pairs + q) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(int(a[r * lda + q]));
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], __m512bh(x),
                                     __m512bh(w[v]));
    }
  }
  if (epilogue != nullptr) {
    for (int v = 0; v < V; ++v) {
      float* at = epilogue->col_max + col0 + 16 * v;
      __m512 top = _mm512_loadu_ps(at);
      for (int r = 0; r < R; ++r) {
        acc[r][v] = _mm512_add_ps(acc[r][v],
                                  _mm512_set1_ps(epilogue->bias[r]));
        top = _mm512_mask_mov_ps(
            top, _mm512_cmp_ps_mask(acc[r][v], top, _CMP_GT_OQ), acc[r][v]);
      }
      _mm512_storeu_ps(at, top);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(c + r * ldc + 16 * v, mask[v], acc[r][v]);
}

// Bf16Block<R, 1> where N leaves a panel no more than 8 columns (the
// last panel, at an H of 200 say): the same sums in 256-bit registers,
// the same bits, and half the work where a 512-bit instruction runs as
// two 256-bit halves (Zen 4).
template <int R>
inline void Bf16BlockNarrow(const uint32_t* a, int64_t lda,
                            const uint32_t* b, int64_t q0, int64_t q1,
                            bool first, float* c, int64_t ldc, int64_t col0,
                            int64_t n, const Bf16Epilogue* epilogue) {
  const int64_t left = n - col0;
  const __mmask8 mask =
      left >= 8 ? __mmask8(0xff)
                : __mmask8((1u << std::max<int64_t>(left, 0)) - 1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r)
    acc[r] = first ? _mm256_setzero_ps()
                   : _mm256_maskz_loadu_ps(mask, c + r * ldc);
  for (int64_t q = q0; q < q1; ++q) {
    const __m256i w =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + q * 16));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_dpbf16_ps(
          acc[r], __m256bh(_mm256_set1_epi32(int(a[r * lda + q]))),
          __m256bh(w));
  }
  if (epilogue != nullptr) {
    float* at = epilogue->col_max + col0;
    __m256 top = _mm256_loadu_ps(at);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_add_ps(acc[r], _mm256_set1_ps(epilogue->bias[r]));
      top = _mm256_mask_mov_ps(
          top, _mm256_cmp_ps_mask(acc[r], top, _CMP_GT_OQ), acc[r]);
    }
    _mm256_storeu_ps(at, top);
  }
  for (int r = 0; r < R; ++r)
    _mm256_mask_storeu_ps(c + r * ldc, mask, acc[r]);
}

// Bf16Block over `rows` rows: kBf16Rows at a time, then one smaller block.
template <int V, int R = kBf16Rows>
inline void Bf16Rows(int64_t rows, const uint32_t* a, int64_t lda,
                     int64_t pairs, const uint32_t* b, int64_t q0, int64_t q1, bool first,
                     float* c, int64_t ldc, int64_t col0, int64_t n,
                     const Bf16Epilogue* epilogue = nullptr) {
  int64_t r = 0;
  Bf16Epilogue here;
  if constexpr (V == 1) {
    if (n - col0 <= 8) {
      for (; r + R <= rows; r += R)
        Bf16BlockNarrow<R>(a + r * lda, lda, b, q0, q1, first, c + r * ldc,
                           ldc, col0, n, RowsFrom(epilogue, r, here));
    }
  }
  for (; r + R <= rows; r += R)
    Bf16Block<R, V>(a + r * lda, lda, pairs, b, q0, q1, first, c + r * ldc,
                    ldc, col0, n, RowsFrom(epilogue, r, here));
  if constexpr (R > 1) {
    if (r < rows)
      Bf16Rows<V, R - 1>(rows - r, a + r * lda, lda, pairs, b, q0, q1, first,
                         c + r * ldc, ldc, col0, n,
                         RowsFrom(epilogue, r, here));
  }
}

// C[rows, n] = A B (first) or C + A B, pairs [q0, q1) of K: A's rows
// packed (PackRows, lda pairs apart), B's panels packed (PackPanels,
// `pairs` pairs each), C's columns past n untouched.
inline void Bf16Panels(int64_t rows, const uint32_t* a, int64_t lda,
                       const uint32_t* b, int64_t pairs, int64_t n,
                       int64_t q0, int64_t q1, bool first, float* c,
                       int64_t ldc) {
  const int64_t panels = (n + 15) / 16;
  int64_t p = 0;
  for (; p + kBf16Vectors <= panels; p += kBf16Vectors)
    Bf16Rows<kBf16Vectors>(rows, a, lda, pairs, b + p * pairs * 16, q0, q1,
                           first, c + p * 16, ldc, p * 16, n);
  for (; p < panels; ++p)
    Bf16Rows<1>(rows, a, lda, pairs, b + p * pairs * 16, q0, q1, first,
                c + p * 16, ldc, p * 16, n);
}

// C[m, n] = op(A)[m, k] op(B)[k, n]: A's rows split over the threads, B
// packed once (by all threads, a share of panels each).
void Bf16Matmul(int64_t m, int64_t n, int64_t k, const Operand& a,
                const Operand& b, float* c, int threads,
                ffi::ThreadPool* pool) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    std::fill(c, c + m * n, 0.0f);
    return;
  }
  const int64_t pairs = (k + 1) / 2, panels = (n + 15) / 16;
  std::vector<uint32_t> packed_a(size_t(m * pairs));
  std::vector<uint32_t> packed_b(size_t(panels * pairs * 16));
  struct Range { int64_t first, last; };
  auto ranges = [&](int64_t total) {
    std::vector<Range> parts;
    const int64_t count = std::min<int64_t>(std::max(threads, 1), total);
    for (int64_t i = 0; i < count; ++i)
      parts.push_back({total * i / count, total * (i + 1) / count});
    return Spread(parts, int(count));
  };
  Run(ranges(panels), pool, [&](const Range& r) {
    PackPanels(b, r.first, r.last, k, n, packed_b.data());
  });
  Run(ranges(m), pool, [&](const Range& r) {
    PackRows(a, r.first, r.last, k, packed_a.data());
    for (int64_t q0 = 0; q0 < pairs; q0 += kBf16PairsBlock) {
      const int64_t q1 = std::min(pairs, q0 + kBf16PairsBlock);
      for (int64_t i0 = r.first; i0 < r.last; i0 += kBf16RowChunk) {
        const int64_t rows = std::min<int64_t>(kBf16RowChunk, r.last - i0);
        Bf16Panels(rows, packed_a.data() + i0 * pairs, pairs,
                   packed_b.data(), pairs, n, q0, q1, q0 == 0, c + i0 * n,
                   n);
      }
    }
  });
}
#else
constexpr bool kBf16Matmul = false;
#endif

}  // namespace

#endif  // ZEBRA_NATIVE_BF16_MATMUL_H_
