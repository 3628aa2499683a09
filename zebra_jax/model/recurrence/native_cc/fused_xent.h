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
// float32 sums; the softmax and d_b in float32), and d_E's product waits
// for a thread's last chunk: its d_logits kept in bf16 pairs (half the
// float32 bytes), one pass over d_E where float32 makes one a chunk.
//
// Threads split the rows: each runs whole chunks of its own rows, in order,
// into its own d_E and d_b (summed over its rows in row order); the partials
// are then added in thread order. Any run with the same thread count gives
// the same bits; another count adds d_E's and d_b's rows in other groups
// (the loss and d_h are the same bits whatever the count).
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
// d_b [V].
struct XentBuffers {
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
  float* d_e;
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
};

// One thread's buffers for its chunks: hᵀ (float32 logits), h's rows with
// a 1 after them (d_E's right side), a chunk's d_h, and bf16's packings.
struct XentRows {
  std::vector<float> rows_t, rows, d_rows;
  std::vector<uint32_t> left, right;
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
// d_logits = softmax - onehot (0 in the lanes past m).
void Softmax(const XentBuffers& io, int chunk, int64_t r0, int m,
             float* logits) {
  const int64_t v_size = io.v;
  const bool grads = io.d_h != nullptr;
  for (int g = 0; g < chunk; g += kLanes) {
    Vec top = Vec{} - std::numeric_limits<float>::infinity();
    for (int64_t v = 0; v < v_size; ++v) {
      float* at = logits + v * chunk + g;
      const Vec x = Load(at) + io.b[v];
      Store(at, x);
      top = Select(x > top, x, top);
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
      scale[i] = 1.0f / total[i];  // lanes past m: 0, no gradient
    }
    if (!grads) continue;
    for (int64_t v = 0; v < v_size; ++v) {
      float* at = logits + v * chunk + g;
      Store(at, Load(at) * scale);
    }
    for (int i = 0; i < kLanes && g + i < m; ++i) {
      const int64_t t = io.targets[r0 + g + i];
      if (t >= 0 && t < v_size) logits[t * chunk + g + i] -= 1.0f;
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
// float32 sums: A packed by rows (`pairs` a row), B by 16-column panels;
// A's rows in blocks of kXentRowsBlock across every panel, K in blocks of
// kBf16PairsBlock.
void Bf16Product(int64_t rows, int64_t n, int64_t pairs, const uint32_t* a,
                 const uint32_t* b, float* c, int64_t ldc, bool accumulate) {
  const int64_t panels = (n + 15) / 16;
  for (int64_t q0 = 0; q0 < pairs; q0 += kBf16PairsBlock) {
    const int64_t q1 = std::min(pairs, q0 + kBf16PairsBlock);
    const bool first = q0 == 0 && !accumulate;
    for (int64_t r0 = 0; r0 < rows; r0 += kXentRowsBlock) {
      const int64_t here = std::min<int64_t>(kXentRowsBlock, rows - r0);
      const uint32_t* ar = a + r0 * pairs;
      float* cr = c + r0 * ldc;
      int64_t p = 0;
      for (; p + 2 <= panels; p += 2)
        Bf16Rows<2>(here, ar, pairs, b + p * pairs * 16, q0, q1, first,
                    cr + p * 16, ldc, p * 16, n);
      if (p < panels)
        Bf16Rows<1>(here, ar, pairs, b + p * pairs * 16, q0, q1, first,
                    cr + p * 16, ldc, p * 16, n);
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
  Bf16Product(io.v, chunk, pairs, packed.e_rows, s.right.data(), logits,
              chunk, false);
}

// d_hᵀ [H, chunk] = Eᵀ d_logitsᵀ, then d_h's rows (stride hp) from it.
void LogitsGradBf16(const XentBuffers& io, const XentPacked& packed,
                    int64_t hp, int chunk, int m, const float* d_logits,
                    XentRows& s) {
  const int64_t pairs = (io.v + 1) / 2;
  PackPanels(Operand{d_logits, chunk, true}, 0, chunk / 16, io.v, m,
             s.right.data());
  float* d_t = s.rows_t.data();  // [H, chunk]
  Bf16Product(io.h, chunk, pairs, packed.e_cols, s.right.data(), d_t, chunk,
              false);
  for (int i = 0; i < m; ++i)
    for (int64_t k = 0; k < io.h; ++k)
      s.d_rows[i * hp + k] = d_t[k * chunk + i];
}

// A chunk's d_logits in bf16 pairs at its rows' place among the part's
// (s.left, [V, pairs], rows from part_row), and d_b (d_E's column H) +=
// their float32 sums, as XLA's bias gradient beside cpu_bf16_head's
// products. d_E's own product waits for the part's last chunk
// (EmbedGradBf16): one pass over d_E, not one a chunk.
void KeepLogitsGradBf16(const XentBuffers& io, int64_t hp, int chunk,
                        int64_t part_row, int m, int64_t pairs,
                        const float* d_logits, XentRows& s, bool first,
                        float* d_e) {
  for (int64_t v = 0; v < io.v; ++v) {
    const float* row = d_logits + v * chunk;
    uint16_t* out =
        reinterpret_cast<uint16_t*>(s.left.data() + v * pairs) + part_row;
    Vec lanes = Vec{};  // the lanes past m hold 0
    for (int j = 0; j < m; j += 16) {  // m values: the next chunk's follow
      const __mmask16 mask =
          m - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (m - j)) - 1);
      _mm256_mask_storeu_epi16(
          out + j, mask, __m256i(_mm512_cvtneps_pbh(_mm512_loadu_ps(row + j))));
    }
    if (m % 2) out[m] = 0;  // the part's last row: its pair's other half
    for (int g = 0; g < chunk; g += kLanes) lanes += Load(row + g);
    float sum = first ? 0.0f : d_e[v * hp + io.h];
    for (int i = 0; i < kLanes; ++i) sum += lanes[i];
    d_e[v * hp + io.h] = sum;
  }
}

// The part's d_E [V, H] = d_logitsᵀ h in bf16, K its rows (float32 sums).
void EmbedGradBf16(const XentBuffers& io, int64_t hp, const XentPart& part,
                   int64_t pairs, XentRows& s) {
  PackPanels(Operand{io.hidden + part.first * io.h, io.h, true}, 0,
             (io.h + 15) / 16, part.last - part.first, io.h, s.right.data());
  Bf16Product(io.v, io.h, pairs, s.left.data(), s.right.data(), part.d_e,
              hp, false);
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
  Softmax(io, chunk, r0, m, logits);
  if (io.d_h == nullptr) return;
#ifdef ZEBRA_BF16_MATMUL
  if (packed.bf16)
    LogitsGradBf16(io, packed, hp, chunk, m, logits, s);
  else
#endif
    LogitsGrad(io, packed.e_panels, hp, chunk, m, logits, s);
  for (int i = 0; i < m; ++i)
    std::copy(s.d_rows.begin() + i * hp, s.d_rows.begin() + i * hp + io.h,
              io.d_h + (r0 + i) * io.h);
#ifdef ZEBRA_BF16_MATMUL
  if (packed.bf16)
    return KeepLogitsGradBf16(io, hp, chunk, r0 - part.first, m,
                              (part.last - part.first + 1) / 2, logits, s,
                              first, part.d_e);
#endif
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
    Run(ranges(v_size, count), pool, [&](const Range& r) {
      PackRows(Operand{io.e, h_size, false}, r.first, r.last, h_size,
               e_rows.data());
    });
    if (grads)
      Run(ranges(h_size, count), pool, [&](const Range& r) {
        PackRows(Operand{io.e, h_size, true}, r.first, r.last, v_size,
                 e_cols.data());
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
  const int64_t per_part = (grads ? v_size * hp : 0) + v_size * chunk;
  auto& work = XentScratch<float>(0, size_t(count * per_part));
  std::vector<XentPart> parts;
  for (const auto& share : ranges(io.n, count))
    for (const Range& r : share) {
      float* base = work.data() + parts.size() * per_part;
      parts.push_back(
          {r.first, r.last, base, base + (grads ? v_size * hp : 0)});
    }
  Run(Spread(parts, int(count)), pool, [&](const XentPart& part) {
    XentRows s;
    s.rows_t.resize(size_t(h_size * chunk));
    s.rows.assign(grads ? size_t(chunk * hp) : 0, 0.0f);
    s.d_rows.resize(grads ? size_t(chunk * hp) : 0);
    const int64_t pairs = (part.last - part.first + 1) / 2;
    if (bf16) {
      s.left.assign(grads ? size_t(v_size * pairs) : 0, 0u);
      s.right.resize(std::max({chunk * pairs_h, grads ? chunk * pairs_v : 0,
                               grads ? (h_size + 15) / 16 * 16 * pairs : 0}));
    }
    for (int64_t r0 = part.first; r0 < part.last; r0 += chunk) {
      const int m = int(std::min<int64_t>(chunk, part.last - r0));
      XentChunk(io, packed, hp, chunk, r0, m, part, r0 == part.first, s);
    }
#ifdef ZEBRA_BF16_MATMUL
    if (bf16 && grads) EmbedGradBf16(io, hp, part, pairs, s);
#endif
  });
  if (!grads) return;
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
