// The tied softmax head's loss and its gradients by chunks of rows, the
// [N, V] logits never written whole: for each chunk of rows, its logits
// (transposed, [V, chunk], so the softmax's sums run down the lanes, one row
// a lane, with no sum across a vector), their max and log-sum-exp, the
// loss, then d_logits = softmax - onehot in place, d_h = d_logits E and
// d_E += d_logitsᵀ h, d_b as one more column of that product (h's rows with
// a 1 after them). Why: XLA runs the head as three matmuls with passes over
// a materialised [N, V] float32 array and its gradient between them; a
// chunk's [V, chunk] stays in a core's L2 or L3.
//
// With bf16 (builds with AVX512_BF16 only), the three products run on the
// bf16 units as bf16_matmul.h's (operands rounded to bf16, d_logits too,
// float32 sums; the softmax and d_b in float32). d_logits is finished
// (scaled, the onehot taken off) as it is rounded and packed, one pass
// over the chunk, into d_h's panels and into one [V, N] buffer for all
// rows (a whole line at a time past the caches); d_E's product waits for
// every chunk and runs once, the threads splitting the vocabulary, each
// element summed over all N rows in order.
//
// Threads split the rows: each runs whole chunks of its own rows, in order
// (with bf16, from a row starting a cache line of d_logits). float32: each
// into its own d_E and d_b, added in thread order at the end; bf16: d_b
// alone, so. Any run with the same thread count gives the same bits;
// another count adds d_b's rows (float32: and d_E's) in other groups. The
// loss and d_h, and bf16's d_E, are the same bits whatever the count.
//
// Part of native.cc's one translation unit: an unnamed namespace, as there.

#ifndef ZEBRA_NATIVE_FUSED_XENT_H_
#define ZEBRA_NATIVE_FUSED_XENT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "bf16_matmul.h"
#include "matmul.h"
#include "threads.h"

namespace {

typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// e^x in float32 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r,
// 2^n into the exponent bits; about 1 ulp), 0 below -87.3 (where e^x is
// subnormal: nothing a sum of exponentials at least 1 keeps), NaN kept.
inline Vec Exp(Vec x) {
  const Vec low = Vec{} - 87.33654f;
  const Vec clamped = Select(x > 88.0f, Vec{} + 88.0f,
                             Select(x < low, low, x));
  const Vec round = Vec{} + 12582912.0f;  // 1.5 x 2^23: rounds to integers
  const Vec n = (clamped * 1.44269504088896341f + round) - round;
  Vec r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  Vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Vec y = p * (r * r) + r + 1.0f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  return Select(x < low, Vec{}, y * (Vec)bits);
}

// The buffers of one call: h [N, H], e [V, H], b [V], targets [N];
// results loss [N] and, when d_h is not null, d_h [N, H], d_e [V, H],
// d_b [V]: the gradients of the losses' sum times grad_scale, folded into
// d_logits (softmax x grad_scale - onehot x grad_scale) so that no pass
// over d_E scales it afterwards. 1 gives the sum's own bits.
struct XentBuffers {
  float grad_scale = 1.0f;
  int64_t n, v, h;
  const float* hidden;
  const float* e;
  const float* b;
  const int32_t* targets;
  float* loss;
  float* d_h = nullptr;
  float* d_e = nullptr;
  float* d_b = nullptr;
};

constexpr int kXentRowsBlock = 128;  // E's rows a register pass covers (L1)
constexpr int kXentLine = 32;        // bf16 values in a 64-byte cache line
constexpr int kXentDepth = 512;      // E's rows per pass of d_h's sums (L2)

// A width rounded up to whole panels of kPanel columns (the products write
// whole panels; the columns past the data are zero).
inline int64_t Padded(int64_t width) {
  return (width + kPanel - 1) / kPanel * kPanel;
}

// One thread's work and what it keeps: its rows [first, last), its d_E
// (with d_b as column H) and a chunk's logits, [V, chunk].
struct XentPart {
  int64_t first, last;
  float* d_e;  // float32: [V, hp], d_b as its column H; bf16: none
  float* d_b;  // bf16: [V] (its d_E is all rows'); float32: none
  float* logits;
};

// What a call packs once for its chunks' products: float32, E by panels of
// kPanel columns (Pack) for d_h; bf16 (bf16_matmul.h's layouts), E's rows
// and Eᵀ's rows, each in pairs of bf16.
struct XentPacked {
  bool bf16 = false;
  const float* e_panels = nullptr;
  const uint32_t* e_rows = nullptr;  // [V, pairs of H]
  const uint32_t* e_cols = nullptr;  // [H, pairs of V]
  uint16_t* d_logits = nullptr;      // bf16: [V, N rounded up to even]
  int64_t d_logits_stride = 0;       // its row's bf16 values
};

// One thread's buffers for its chunks: hᵀ (float32 logits), h's rows with
// a 1 after them (d_E's right side), a chunk's d_h, its lanes' softmax
// scales, and bf16's packings.
struct XentRows {
  std::vector<float> rows_t, rows, d_rows, scales, tops;
  std::vector<uint32_t> right;
};

// logitsᵀ [V, chunk] = E hᵀ in float32, a block of E's rows at a time
// across the chunk's panels (E's rows read once from memory).
void Logits(const XentBuffers& io, int chunk, int64_t r0, int m,
            XentRows& s, float* logits) {
  const int64_t h_size = io.h;
  std::fill(s.rows_t.begin(), s.rows_t.end(), 0.0f);  // rows past m: 0
  for (int i = 0; i < m; ++i)
    for (int64_t k = 0; k < h_size; ++k)
      s.rows_t[k * chunk + i] = io.hidden[(r0 + i) * h_size + k];
  for (int64_t v0 = 0; v0 < io.v; v0 += kXentRowsBlock) {
    const int rows_here = int(std::min<int64_t>(kXentRowsBlock, io.v - v0));
    for (int j = 0; j < chunk; j += kPanel)
      Columns<kVectors>(rows_here, int(h_size), io.e + v0 * h_size, h_size,
                        s.rows_t.data() + j, chunk, nullptr, 0,
                        logits + v0 * chunk + j, chunk);
  }
}

// The chunk's softmax down the lanes, kLanes rows at a time: the bias
// added, the losses written, and with gradients the logits replaced by
// d_logits = softmax - onehot (0 in the lanes past m); given `scales`, by
// the exponentials only, each lane's 1 / sum in scales (PackLogitsGradBf16
// finishes d_logits as it packs them); given `tops`, the logits already
// hold the bias and tops their max (LogitsBf16).
void Softmax(const XentBuffers& io, int chunk, int64_t r0, int m,
             float* logits, float* scales = nullptr,
             const float* tops = nullptr) {
  const int64_t v_size = io.v;
  const bool grads = io.d_h != nullptr;
  for (int g = 0; g < chunk; g += kLanes) {
    Vec top = Vec{} - std::numeric_limits<float>::infinity();
    if (tops != nullptr) {  // the product added the bias and kept the max
      top = Load(tops + g);
    } else {
      for (int64_t v = 0; v < v_size; ++v) {
        float* at = logits + v * chunk + g;
        const Vec x = Load(at) + io.b[v];
        Store(at, x);
        top = Select(x > top, x, top);
      }
    }
    float picked[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      const int64_t t = g + i < m ? io.targets[r0 + g + i] : -1;
      picked[i] = t >= 0 && t < v_size
                      ? logits[t * chunk + g + i]
                      : std::numeric_limits<float>::quiet_NaN();
    }
    Vec total = Vec{};
    for (int64_t v = 0; v < v_size; ++v) {
      float* at = logits + v * chunk + g;
      const Vec x = Exp(Load(at) - top);
      if (grads) Store(at, x);
      total += x;
    }
    Vec scale = Vec{};
    for (int i = 0; i < kLanes && g + i < m; ++i) {
      io.loss[r0 + g + i] = std::log(total[i]) + top[i] - picked[i];
      scale[i] = 1.0f / total[i] * io.grad_scale;  // past m: 0, no gradient
    }
    if (!grads) continue;
    if (scales != nullptr) {  // the caller scales as it packs (bf16)
      Store(scales + g, scale);
      continue;
    }
    for (int64_t v = 0; v < v_size; ++v) {
      float* at = logits + v * chunk + g;
      Store(at, Load(at) * scale);
    }
    for (int i = 0; i < kLanes && g + i < m; ++i) {
      const int64_t t = io.targets[r0 + g + i];
      if (t >= 0 && t < v_size) logits[t * chunk + g + i] -= io.grad_scale;
    }
  }
}

// d_h [m, H] (row stride hp, in s.d_rows) = d_logits E in float32:
// d_logits read transposed from the chunk (a_step), E's panels in blocks
// of rows that stay in L2 across the chunk's rows.
void LogitsGrad(const XentBuffers& io, const float* e_panels, int64_t hp,
                int chunk, int m, const float* d_logits, XentRows& s) {
  for (int64_t v0 = 0; v0 < io.v; v0 += kXentDepth) {
    const int depth = int(std::min<int64_t>(kXentDepth, io.v - v0));
    for (int64_t j = 0; j < Padded(io.h); j += kPanel) {
      Term term{depth, d_logits + v0 * chunk, 1,
                e_panels + j * io.v + v0 * kPanel, kPanel, chunk};
      float* out = s.d_rows.data() + j;
      Columns<kVectors>(m, std::array<Term, 1>{term},
                        v0 ? out : nullptr, hp, out, hp);
    }
  }
}

// d_E [V, H + 1] (row stride hp) += d_logitsᵀ [h | 1] in float32 (first:
// written, not added to).
void EmbedGrad(const XentBuffers& io, int64_t hp, int chunk, int m,
               const float* d_logits, const XentRows& s, bool first,
               float* d_e) {
  for (int64_t v0 = 0; v0 < io.v; v0 += kXentRowsBlock) {
    const int rows_here = int(std::min<int64_t>(kXentRowsBlock, io.v - v0));
    for (int64_t j = 0; j < hp; j += kPanel) {
      float* out = d_e + v0 * hp + j;
      Columns<kVectors>(rows_here, m, d_logits + v0 * chunk, chunk,
                        s.rows.data() + j, hp, first ? nullptr : out, hp,
                        out, hp);
    }
  }
}

#ifdef ZEBRA_BF16_MATMUL
// C [rows, n] (row stride ldc) = A B, or += (accumulate), in bf16 with
// float32 sums: A packed by rows (`pairs` a row, rows lda pairs apart: 0,
// `pairs`), B by 16-column panels; A's rows in blocks of kXentRowsBlock
// across every panel, K in blocks of kBf16PairsBlock.
void Bf16Product(int64_t rows, int64_t n, int64_t pairs, const uint32_t* a,
                 const uint32_t* b, float* c, int64_t ldc, bool accumulate,
                 const Bf16Epilogue* epilogue = nullptr, int64_t lda = 0) {
  if (lda == 0) lda = pairs;
  const int64_t panels = (n + 15) / 16;
  for (int64_t q0 = 0; q0 < pairs; q0 += kBf16PairsBlock) {
    const int64_t q1 = std::min(pairs, q0 + kBf16PairsBlock);
    const bool first = q0 == 0 && !accumulate;
    const bool last = q1 == pairs;
    for (int64_t r0 = 0; r0 < rows; r0 += kXentRowsBlock) {
      const int64_t here = std::min<int64_t>(kXentRowsBlock, rows - r0);
      const uint32_t* ar = a + r0 * lda;
      float* cr = c + r0 * ldc;
      Bf16Epilogue rows_here;
      const Bf16Epilogue* on_store =
          last ? RowsFrom(epilogue, r0, rows_here) : nullptr;
      int64_t p = 0;
      for (; p + 2 <= panels; p += 2)
        Bf16Rows<2>(here, ar, lda, pairs, b + p * pairs * 16, q0, q1, first,
                    cr + p * 16, ldc, p * 16, n, on_store);
      if (p < panels)
        Bf16Rows<1>(here, ar, lda, pairs, b + p * pairs * 16, q0, q1, first,
                    cr + p * 16, ldc, p * 16, n, on_store);
    }
  }
}

// The three products in bf16 (bf16_matmul.h's rounding: operands to bf16,
// float32 sums), the float32 ones' results in the same buffers.
void LogitsBf16(const XentBuffers& io, const XentPacked& packed, int chunk,
                int64_t r0, int m, XentRows& s, float* logits) {
  const int64_t pairs = (io.h + 1) / 2;
  PackPanels(Operand{io.hidden + r0 * io.h, io.h, false}, 0, chunk / 16,
             io.h, m, s.right.data());
  std::fill(s.tops.begin(), s.tops.end(),
            -std::numeric_limits<float>::infinity());
  const Bf16Epilogue bias_and_max{io.b, s.tops.data()};
  Bf16Product(io.v, chunk, pairs, packed.e_rows, s.right.data(), logits,
              chunk, false, &bias_and_max);
}

// d_logits = exponentials x scale - onehot, from Softmax's exponentials,
// rounded to bf16 once and written where both products read them, one pass
// over the chunk: d_h's right side (s.right: panels of 16 rows, V in
// pairs, as PackPanels lays them out) and the chunk's rows at their place
// among all N (packed.d_logits, [V, N]) for d_E's product once every chunk
// is done; and the part's d_b += their float32 sums, as XLA's bias
// gradient beside cpu_bf16_head's products (each word's 16 lanes added in
// order, 16 words at a time: their vectors transposed). A whole chunk of
// whole cache lines of [V, N] (chunk a multiple of kXentLine rows from a
// line, as the parts start) is written a line at a time past the caches:
// d_E's product reads it only after every chunk, and a line stored in
// halves would first be read from memory.
void PackLogitsGradBf16(const XentBuffers& io, const XentPacked& packed,
                        int chunk, int64_t r0, int m, const float* exps,
                        const float* scales, XentRows& s, bool first,
                        float* d_b) {
  const int64_t v_size = io.v, v_pairs = (v_size + 1) / 2;
  const int groups = chunk / 16;
  std::vector<int32_t> targets(static_cast<size_t>(chunk));  // -1 past m
  std::vector<__mmask16> masks(static_cast<size_t>(groups));
  for (int i = 0; i < chunk; ++i) targets[i] = i < m ? io.targets[r0 + i] : -1;
  for (int p = 0; p < groups; ++p) {
    const int left = std::max(0, std::min(16, m - p * 16));
    masks[p] = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
  }
  const int64_t stride = packed.d_logits_stride;
  uint16_t* rows = packed.d_logits + r0;
  const bool lines = m == chunk && chunk % kXentLine == 0 &&
                     stride % kXentLine == 0 &&
                     reinterpret_cast<uintptr_t>(rows) % 64 == 0;
  uint32_t* panels = s.right.data();
  const __m512 one = _mm512_set1_ps(io.grad_scale);  // the onehot, scaled
  __m512 sums[16] = {};  // 16 words' lanes: d_b's terms (past V: unused)
  __m256i low[2];   // a line's first half, each word of the pair
  for (int64_t q = 0; q < v_pairs; ++q) {
    __m512* pair_sums = sums + 2 * (q % 8);
    pair_sums[0] = pair_sums[1] = _mm512_setzero_ps();
    for (int p = 0; p < groups; ++p) {
      const __m512 scale = _mm512_loadu_ps(scales + p * 16);
      __m512i halves[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int half = 0; half < 2; ++half) {
        const int64_t v = 2 * q + half;
        if (v >= v_size) break;
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(exps + v * chunk + p * 16),
                                 scale);
        const __mmask16 hit = _mm512_cmpeq_epi32_mask(
            _mm512_loadu_si512(targets.data() + p * 16),
            _mm512_set1_epi32(int32_t(v)));
        x = _mm512_mask_sub_ps(x, hit, x, one);
        pair_sums[half] = _mm512_add_ps(pair_sums[half], x);
        const __m256i rounded = __m256i(_mm512_cvtneps_pbh(x));
        halves[half] = _mm512_cvtepu16_epi32(rounded);
        uint16_t* at = rows + v * stride + p * 16;
        if (!lines) {
          if (masks[p]) _mm256_mask_storeu_epi16(at, masks[p], rounded);
        } else if (p % 2 == 0) {
          low[half] = rounded;
        } else {
          _mm512_stream_si512(
              reinterpret_cast<__m512i*>(at - 16),
              _mm512_inserti64x4(_mm512_castsi256_si512(low[half]), rounded,
                                 1));
        }
      }
      _mm512_storeu_si512(
          panels + (p * v_pairs + q) * 16,
          _mm512_or_si512(halves[0], _mm512_slli_epi32(halves[1], 16)));
    }
    if (m % 2)  // N odd: the last row's pair's other half
      for (int64_t v = 2 * q; v < std::min(2 * q + 2, v_size); ++v)
        rows[v * stride + m] = 0;
    if (q % 8 == 7 || q == v_pairs - 1) {  // d_b, the 16 words from v0
      const int64_t v0 = q / 8 * 16;
      const int64_t words = std::min<int64_t>(16, v_size - v0);
      const __mmask16 here = __mmask16((1u << words) - 1);
      __m512i lanes[16];
      for (int w = 0; w < 16; ++w) lanes[w] = _mm512_castps_si512(sums[w]);
      Transpose16(lanes);  // lanes[i]: lane i of each word
      __m512 sum = _mm512_maskz_loadu_ps(first ? 0 : here, d_b + v0);
      for (int i = 0; i < 16; ++i)
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(lanes[i]));
      _mm512_mask_storeu_ps(d_b + v0, here, sum);
    }
  }
  if (lines) _mm_sfence();  // the streamed lines before any other reader
}

// d_hᵀ [H, chunk] = Eᵀ d_logitsᵀ from PackLogitsGradBf16's panels, then
// d_h's rows (stride hp) from it.
void LogitsGradBf16(const XentBuffers& io, const XentPacked& packed,
                    int64_t hp, int chunk, int m, XentRows& s) {
  const int64_t pairs = (io.v + 1) / 2;
  float* d_t = s.rows_t.data();  // [H, chunk]
  Bf16Product(io.h, chunk, pairs, packed.e_cols, s.right.data(), d_t, chunk,
              false);
  for (int i = 0; i < m; ++i)
    for (int64_t k = 0; k < io.h; ++k)
      s.d_rows[i * hp + k] = d_t[k * chunk + i];
}

// d_E's rows [v0, v1) = d_logitsᵀ h in bf16, K all N rows in order
// (float32 sums): the same bits whatever the thread count. h is packed
// whole by each thread (N x H values: little beside the product).
void EmbedGradBf16(const XentBuffers& io, const XentPacked& packed,
                   int64_t v0, int64_t v1, XentRows& s) {
  const int64_t pairs = (io.n + 1) / 2, lda = packed.d_logits_stride / 2;
  s.right.resize(size_t((io.h + 15) / 16 * 16 * pairs));
  PackPanels(Operand{io.hidden, io.h, true}, 0, (io.h + 15) / 16, io.n,
             io.h, s.right.data());
  Bf16Product(v1 - v0, io.h, pairs,
              reinterpret_cast<const uint32_t*>(packed.d_logits) + v0 * lda,
              s.right.data(), io.d_e + v0 * io.h, io.h, false, nullptr, lda);
}
#endif

// Rows [r0, r0 + m) of one chunk: the losses, and with gradients the
// chunk's d_h rows and its share of the part's d_E (first: written, not
// added to).
void XentChunk(const XentBuffers& io, const XentPacked& packed, int64_t hp,
               int chunk, int64_t r0, int m, const XentPart& part,
               bool first, XentRows& s) {
  float* logits = part.logits;
#ifdef ZEBRA_BF16_MATMUL
  if (packed.bf16)
    LogitsBf16(io, packed, chunk, r0, m, s, logits);
  else
#endif
    Logits(io, chunk, r0, m, s, logits);
#ifdef ZEBRA_BF16_MATMUL
  if (packed.bf16 && io.d_h != nullptr) {
    Softmax(io, chunk, r0, m, logits, s.scales.data(), s.tops.data());
    PackLogitsGradBf16(io, packed, chunk, r0, m, logits, s.scales.data(), s,
                       first, part.d_b);
    LogitsGradBf16(io, packed, hp, chunk, m, s);
    for (int i = 0; i < m; ++i)
      std::copy(s.d_rows.begin() + i * hp, s.d_rows.begin() + i * hp + io.h,
                io.d_h + (r0 + i) * io.h);
    return;
  }
#endif
  Softmax(io, chunk, r0, m, logits, nullptr,
          packed.bf16 ? s.tops.data() : nullptr);
  if (io.d_h == nullptr) return;
  LogitsGrad(io, packed.e_panels, hp, chunk, m, logits, s);
  for (int i = 0; i < m; ++i)
    std::copy(s.d_rows.begin() + i * hp, s.d_rows.begin() + i * hp + io.h,
              io.d_h + (r0 + i) * io.h);
  // d_E's right side: h's rows with a 1 after them (d_b's column).
  for (int i = 0; i < m; ++i) {
    std::copy(io.hidden + (r0 + i) * io.h, io.hidden + (r0 + i + 1) * io.h,
              s.rows.begin() + i * hp);
    s.rows[i * hp + io.h] = 1.0f;
  }
  EmbedGrad(io, hp, chunk, m, logits, s, first, part.d_e);
}

// Per-call scratch, kept by the calling thread between calls: the head's
// buffers are tens of MB, which fresh allocations would fault in page by
// page on every call.
template <typename T>
std::vector<T>& XentScratch(int which, size_t size) {
  thread_local std::vector<T> buffers[3];
  if (buffers[which].size() < size) buffers[which].resize(size);
  return buffers[which];
}

// The whole call: E packed once (a share a thread), the rows' parts, then
// (with gradients) the parts' d_E and d_b added in order. bf16: the
// products in bf16 (only where ZEBRA_BF16_MATMUL is compiled in).
void FusedXent(const XentBuffers& io, int chunk, bool bf16, int threads,
               ffi::ThreadPool* pool) {
  const int64_t v_size = io.v, h_size = io.h;
  const bool grads = io.d_h != nullptr;
  if (io.n <= 0 || v_size <= 0) {
    if (grads) {
      std::fill(io.d_e, io.d_e + v_size * h_size, 0.0f);
      std::fill(io.d_b, io.d_b + v_size, 0.0f);
    }
    return;
  }
  const int64_t hp = Padded(h_size + 1);  // room for d_b's column
  struct Range { int64_t first, last; };
  auto ranges = [&](int64_t total, int64_t count) {
    std::vector<Range> parts;
    count = std::max<int64_t>(1, std::min<int64_t>(count, total));
    for (int64_t i = 0; i < count; ++i)
      parts.push_back({total * i / count, total * (i + 1) / count});
    return Spread(parts, int(count));
  };
  const int64_t count = std::min<int64_t>(std::max(threads, 1), io.n);
  const int64_t pairs_h = (h_size + 1) / 2, pairs_v = (v_size + 1) / 2;
  XentPacked packed;
  packed.bf16 = bf16;
#ifdef ZEBRA_BF16_MATMUL
  if (bf16) {
    auto& e_rows = XentScratch<uint32_t>(1, size_t(v_size * pairs_h));
    auto& e_cols = XentScratch<uint32_t>(2, grads ? size_t(h_size * pairs_v)
                                                  : 0);
    // Both packings in one pass of the threads, a share of each a part.
    struct Shares { Range rows, cols; };
    std::vector<Shares> shares;
    for (int64_t i = 0; i < count; ++i)
      shares.push_back({{v_size * i / count, v_size * (i + 1) / count},
                        {grads ? h_size * i / count : 0,
                         grads ? h_size * (i + 1) / count : 0}});
    Run(Spread(shares, int(count)), pool, [&](const Shares& share) {
      PackRows(Operand{io.e, h_size, false}, share.rows.first,
               share.rows.last, h_size, e_rows.data());
      PackRows(Operand{io.e, h_size, true}, share.cols.first,
               share.cols.last, v_size, e_cols.data());
    });
    packed.e_rows = e_rows.data();
    packed.e_cols = e_cols.data();
  }
#endif
  if (grads && !bf16) {
    auto& e_panels = XentScratch<float>(
        1, size_t(PackedSize(int(v_size), int(h_size))));
    Run(ranges(Padded(h_size) / kPanel, count), pool, [&](const Range& r) {
      const int64_t j0 = r.first * kPanel;
      Pack(int(v_size), int(std::min(r.last * kPanel, h_size) - j0),
           io.e + j0, h_size, e_panels.data() + j0 * v_size);
    });
    packed.e_panels = e_panels.data();
  }
  // bf16 with gradients: each part's d_b alone ([V]), d_logits in one
  // buffer for all rows, its rows whole cache lines (kXentLine values) and
  // parts starting at a line: a chunk of 32 rows writes a whole line of
  // each vocabulary row, where rows straddling lines cost the packing pass
  // twice its time.
  const bool shared_d_e = bf16 && grads;
  const int64_t grads_size = !grads ? 0 : shared_d_e ? v_size : v_size * hp;
  const int64_t per_part = grads_size + v_size * chunk;
  auto& work = XentScratch<float>(0, size_t(count * per_part));
  if (shared_d_e) {
    packed.d_logits_stride = (io.n + kXentLine - 1) / kXentLine * kXentLine;
    uint16_t* buffer = XentScratch<uint16_t>(
        0, size_t(v_size * packed.d_logits_stride + kXentLine)).data();
    const uintptr_t at = reinterpret_cast<uintptr_t>(buffer);
    packed.d_logits = buffer + ((64 - at % 64) % 64) / sizeof(uint16_t);
  }
  // The parts split the rows evenly; with the shared d_logits, whole
  // lines of them (a part's rows start a line), split evenly by lines.
  const int64_t unit = shared_d_e ? kXentLine : 1;
  std::vector<XentPart> parts;
  for (const auto& share : ranges((io.n + unit - 1) / unit, count))
    for (const Range& r : share) {
      float* base = work.data() + parts.size() * per_part;
      float* d_e = grads && !shared_d_e ? base : nullptr;
      float* d_b = shared_d_e ? base : nullptr;
      parts.push_back({r.first * unit, std::min(r.last * unit, io.n), d_e,
                       d_b, base + grads_size});
    }
  Run(Spread(parts, int(count)), pool, [&](const XentPart& part) {
    // Kept by each thread between calls, as XentScratch: fresh buffers
    // would be faulted in page by page on every call.
    thread_local XentRows s;
    s.rows_t.resize(size_t(h_size * chunk));
    s.rows.assign(grads ? size_t(chunk * hp) : 0, 0.0f);
    s.d_rows.resize(grads ? size_t(chunk * hp) : 0);
    s.scales.resize(size_t(chunk));
    s.tops.resize(size_t(chunk));
    if (bf16)
      s.right.resize(size_t(std::max(chunk * pairs_h,
                                     grads ? chunk * pairs_v : 0)));
    for (int64_t r0 = part.first; r0 < part.last; r0 += chunk) {
      const int m = int(std::min<int64_t>(chunk, part.last - r0));
      XentChunk(io, packed, hp, chunk, r0, m, part, r0 == part.first, s);
    }
  });
  if (!grads) return;
#ifdef ZEBRA_BF16_MATMUL
  if (shared_d_e) {  // d_E by vocabulary rows over all N rows; d_b in order
    Run(ranges(v_size, count), pool, [&](const Range& r) {
      thread_local XentRows s;
      EmbedGradBf16(io, packed, r.first, r.last, s);
      for (int64_t v = r.first; v < r.last; ++v) {
        float sum = 0.0f;
        bool any = false;
        for (const XentPart& part : parts) {
          if (part.first == part.last) continue;
          sum = any ? sum + part.d_b[v] : part.d_b[v];
          any = true;
        }
        io.d_b[v] = sum;
      }
    });
    return;
  }
#endif
  Run(ranges(v_size, count), pool, [&](const Range& r) {
    for (int64_t v = r.first; v < r.last; ++v) {
      float* d_e = io.d_e + v * h_size;
      const float* d_e0 = parts[0].d_e + v * hp;
      std::copy(d_e0, d_e0 + h_size, d_e);
      io.d_b[v] = d_e0[h_size];
      for (size_t p = 1; p < parts.size(); ++p) {
        const float* d_ep = parts[p].d_e + v * hp;
        for (int64_t k = 0; k < h_size; ++k) d_e[k] += d_ep[k];
        io.d_b[v] += d_ep[h_size];
      }
    }
  });
}

}  // namespace

#endif  // ZEBRA_NATIVE_FUSED_XENT_H_
