// The vector helpers every loop is written in: one vector register of
// floats, its loads and stores at any float address, tanh, and Lanes (one
// body for whole vectors and the scalar tail).
//
// Portable C++ with GCC/Clang vector extensions, one vector a register of
// whatever -march targets (AVX-512, AVX2, SSE2, NEON). tanh is a rational
// approximation, the one XLA's CPU backend uses (largest error against
// float64 about 3.5e-7); NaN goes through it as through XLA's.
//
// Part of native.cc's one translation unit: an unnamed namespace, as there.

#ifndef ZEBRA_NATIVE_SIMD_H_
#define ZEBRA_NATIVE_SIMD_H_

#include <cstddef>
#include <cstdint>
#include <utility>

namespace {

// One vector register of floats (kLanes), and the register block of the
// recurrent matmul: kRows rows x kVectors vectors of accumulators, plus
// kVectors of W and one broadcast, within the register file (AVX-512 and
// NEON 32 registers, AVX2 and SSE 16). A vector wider than a register
// would make AVX2 spill its accumulators. The blocks are the fastest
// that fit: AVX-512's 8 x 2 beats 4 x 4 (half the W loads a multiply-add)
// and 6 x 4 and 8 x 3 (a narrower panel of W); AVX2's 6 x 2 beats 4 x 3,
// 4 x 2 and 5 x 2.
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

}  // namespace

#endif  // ZEBRA_NATIVE_SIMD_H_
