// The tied softmax head's loss and its gradients by chunks of rows, the
// [N, V] logits never written whole: for each chunk of rows, its logits
// (transposed, [V, chunk], so the softmax's sums run down the lanes, one row
// a lane, with no sum across a vector), their max and log-sum-exp, the
// loss, then d_logits = softmax - onehot in place, d_h = d_logits E and
// d_E += d_logitsᵀ h, d_b as one more column of that product (h's rows with
// a 1 after them). Why: XLA runs the head as three matmuls with passes over
// a materialised [N, V] float32 array and its gradient between them; a
// chunk's [V, chunk] stays in a core's L2.
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

// Rows [r0, r0 + m) of one chunk: loss, and with d_h, the chunk's d_h rows
// and its share of the part's d_E (first: written, not added to). e_panels:
// E packed by panels of kPanel columns (Pack), what d_h's sums read.
void XentChunk(const XentBuffers& io, const float* e_panels, int64_t hp,
               int chunk, int64_t r0, int m, const XentPart& part,
               bool first, std::vector<float>& rows_t,
               std::vector<float>& rows, std::vector<float>& d_rows) {
  const int64_t v_size = io.v, h_size = io.h;
  const bool grads = io.d_h != nullptr;
  // hᵀ [H, chunk] for the logits, rows past m zero.
  std::fill(rows_t.begin(), rows_t.end(), 0.0f);
  for (int i = 0; i < m; ++i)
    for (int64_t k = 0; k < h_size; ++k)
      rows_t[k * chunk + i] = io.hidden[(r0 + i) * h_size + k];
  float* logits = part.logits;
  // logitsᵀ [V, chunk] = E hᵀ, a block of E's rows at a time across the
  // chunk's panels (E's rows read once from memory).
  for (int64_t v0 = 0; v0 < v_size; v0 += kXentRowsBlock) {
    const int rows_here = int(std::min<int64_t>(kXentRowsBlock, v_size - v0));
    for (int j = 0; j < chunk; j += kPanel)
      Columns<kVectors>(rows_here, int(h_size), io.e + v0 * h_size, h_size,
                        rows_t.data() + j, chunk, nullptr, 0,
                        logits + v0 * chunk + j, chunk);
  }
  // The softmax down the lanes: kLanes rows at a time.
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
      scale[i] = 1.0f / total[i];  // rows past m: 0, no gradient
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
  if (!grads) return;
  // d_h [m, H] = d_logits E: d_logits read transposed from the chunk
  // (a_step), E's panels in blocks of rows that stay in L2 across the
  // chunk's rows.
  for (int64_t v0 = 0; v0 < v_size; v0 += kXentDepth) {
    const int depth = int(std::min<int64_t>(kXentDepth, v_size - v0));
    for (int64_t j = 0; j < Padded(h_size); j += kPanel) {
      Term term{depth, logits + v0 * chunk, 1,
                e_panels + j * v_size + v0 * kPanel, kPanel, chunk};
      float* out = d_rows.data() + j;
      Columns<kVectors>(m, std::array<Term, 1>{term},
                        v0 ? out : nullptr, hp, out, hp);
    }
  }
  for (int i = 0; i < m; ++i)
    std::copy(d_rows.begin() + i * hp, d_rows.begin() + i * hp + h_size,
              io.d_h + (r0 + i) * h_size);
  // d_E [V, H + 1] += d_logitsᵀ [h | 1]: column H is d_b.
  for (int i = 0; i < m; ++i) {
    std::copy(io.hidden + (r0 + i) * h_size,
              io.hidden + (r0 + i + 1) * h_size, rows.begin() + i * hp);
    rows[i * hp + h_size] = 1.0f;
  }
  for (int64_t v0 = 0; v0 < v_size; v0 += kXentRowsBlock) {
    const int rows_here = int(std::min<int64_t>(kXentRowsBlock, v_size - v0));
    for (int64_t j = 0; j < hp; j += kPanel) {
      float* out = part.d_e + v0 * hp + j;
      Columns<kVectors>(rows_here, m, logits + v0 * chunk, chunk,
                        rows.data() + j, hp, first ? nullptr : out, hp, out,
                        hp);
    }
  }
}

// Per-call scratch, kept by the calling thread between calls: the head's
// buffers are tens of MB, which fresh allocations would fault in page by
// page on every call.
std::vector<float>& XentScratch(int which, size_t size) {
  thread_local std::vector<float> buffers[2];
  if (buffers[which].size() < size) buffers[which].resize(size);
  return buffers[which];
}

// The whole call: E packed once for d_h (a share of panels a thread), the
// rows' parts, then (with gradients) the parts' d_E and d_b added in order.
void FusedXent(const XentBuffers& io, int chunk, int threads,
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
    return parts;
  };
  const int64_t count = std::min<int64_t>(std::max(threads, 1), io.n);
  const int64_t panels = Padded(h_size) / kPanel;
  std::vector<float>& e_panels =
      XentScratch(0, grads ? size_t(PackedSize(int(v_size), int(h_size))) : 0);
  if (grads)
    Run(Spread(ranges(panels, count), int(count)), pool, [&](const Range& r) {
      const int64_t j0 = r.first * kPanel;
      Pack(int(v_size), int(std::min(r.last * kPanel, h_size) - j0),
           io.e + j0, h_size, e_panels.data() + j0 * v_size);
    });
  const int64_t per_part = (grads ? v_size * hp : 0) + v_size * chunk;
  std::vector<float>& work = XentScratch(1, size_t(count * per_part));
  std::vector<XentPart> parts;
  for (const Range& r : ranges(io.n, count)) {
    float* base = work.data() + parts.size() * per_part;
    parts.push_back({r.first, r.last, base, base + (grads ? v_size * hp : 0)});
  }
  Run(Spread(parts, int(count)), pool, [&](const XentPart& part) {
    std::vector<float> rows_t(size_t(h_size * chunk));
    std::vector<float> rows(grads ? size_t(chunk * hp) : 0, 0.0f);
    std::vector<float> d_rows(grads ? size_t(chunk * hp) : 0);
    for (int64_t r0 = part.first; r0 < part.last; r0 += chunk) {
      const int m = int(std::min<int64_t>(chunk, part.last - r0));
      XentChunk(io, e_panels.data(), hp, chunk, r0, m, part,
                r0 == part.first, rows_t, rows, d_rows);
    }
  });
  if (!grads) return;
  Run(Spread(ranges(v_size, count), int(count)), pool, [&](const Range& r) {
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
