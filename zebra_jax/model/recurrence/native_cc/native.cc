// A ZebraLSTM layer's time loops on a CPU: one XLA FFI call per loop (the
// backward one with the window's weight gradients where it can). This file
// is the calls themselves: each checks the buffers XLA hands it against the
// window's shape, names them (ForwardBuffers, BackwardBuffers) and runs a
// loop; and the build record native_check.py reads before the library is
// loaded.
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
// One translation unit, compiled alone: the headers beside it each hold one
// concern, lowest first, in an unnamed namespace as the code here is.
//   simd.h          the vector type, loads and stores, tanh, Lanes
//   matmul.h        register blocks, W packed into panels, RowTimesMatrix
//   threads.h       Plan and Run, Units and RunLockstep (XLA's pool)
//   weight_grads.h  a window's d_w_h, d_w_x, d_bias (StripeGrads)
//   lstm.h          the cell, Forward and Backward
//   bf16_matmul.h   a bf16 matmul on AVX512_BF16 units (the tied head's)
//   fused_xent.h    the tied head's loss and gradients by row chunks
// native_build.py's digest of the source covers every file here.

#include <algorithm>
#include <climits>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "bf16_matmul.h"
#include "fused_xent.h"
#include "lstm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// What a time loop's call with `bf16` says in a build without the units.
constexpr const char* kNoBf16 =
    "bf16 is set, and this library was built without AVX512_BF16";

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

// A forward call's buffers, by name: the two forward handlers' shared
// arguments and results, in the order both take them; cs empty: none kept.
ForwardBuffers ForwardBuffersOf(
    const float* x_proj, const ffi::Buffer<ffi::F32>& h0,
    const ffi::Buffer<ffi::F32>& c0, const ffi::Buffer<ffi::F32>& w_h,
    ffi::ResultBuffer<ffi::F32>& ys, ffi::ResultBuffer<ffi::F32>& h,
    ffi::ResultBuffer<ffi::F32>& c, ffi::ResultBuffer<ffi::F32>& cs,
    ffi::ResultBuffer<ffi::F32>& gates) {
  ForwardBuffers io;
  io.x_proj = x_proj;
  io.h0 = h0.typed_data();
  io.c0 = c0.typed_data();
  io.w_h = w_h.typed_data();
  io.ys = ys->typed_data();
  io.h_out = h->typed_data();
  io.c_out = c->typed_data();
  io.cs = cs->element_count() > 0 ? cs->typed_data() : nullptr;
  io.gates = gates->typed_data();
  return io;
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_proj,
                       ffi::Buffer<ffi::F32> h0, ffi::Buffer<ffi::F32> c0,
                       ffi::Buffer<ffi::F32> w_h,
                       ffi::ResultBuffer<ffi::F32> ys,
                       ffi::ResultBuffer<ffi::F32> h,
                       ffi::ResultBuffer<ffi::F32> c,
                       ffi::ResultBuffer<ffi::F32> cs,
                       ffi::ResultBuffer<ffi::F32> gates, int64_t threads,
                       int64_t unit_parts, bool bf16) {
  Shape d;
  std::string why = WindowShape("x_proj", x_proj.dimensions(), &d);
  if (why.empty() && bf16 && !kBf16Matmul) why = kNoBf16;
  const bool keep = cs->element_count() > 0;
  const std::string m = FirstMismatch(
      why, ForwardMismatches(d, keep, h0, c0, w_h, ys, h, c, cs, gates));
  if (!m.empty()) return Failed("zebra_native_forward: " + m);
  ForwardBuffers io = ForwardBuffersOf(x_proj.typed_data(), h0, c0, w_h, ys,
                                       h, c, cs, gates);
  io.bf16 = bf16;
  return Guarded("zebra_native_forward", [&] {
    Forward(d, Clipped(threads), Clipped(unit_parts), &pool, io);
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
  Projection proj;
  proj.x = x.typed_data();
  proj.w_x = w_x.typed_data();
  proj.bias = bias.typed_data();
  proj.width = int(width);
  // No projected window: the projection starts each step's gates.
  const ForwardBuffers io = ForwardBuffersOf(nullptr, h0, c0, w_h, ys, h, c,
                                             cs, gates);
  return Guarded("zebra_native_forward_projected", [&] {
    Forward(d, Clipped(threads), 1, &pool, io, &proj);
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

// A backward call's buffers, by name: the two backward handlers' shared
// arguments, in the order both take them.
BackwardBuffers BackwardBuffersOf(
    const ffi::Buffer<ffi::F32>& d_ys, const ffi::Buffer<ffi::F32>& gates,
    const ffi::Buffer<ffi::F32>& cs, const ffi::Buffer<ffi::F32>& c0,
    const ffi::Buffer<ffi::F32>& w_t, const ffi::Buffer<ffi::F32>& dh_last,
    const ffi::Buffer<ffi::F32>& dc_last, ffi::ResultBuffer<ffi::F32>& dz,
    ffi::ResultBuffer<ffi::F32>& dh0, ffi::ResultBuffer<ffi::F32>& dc0) {
  BackwardBuffers io;
  io.d_ys = d_ys.typed_data();
  io.gates = gates.typed_data();
  io.cs = cs.typed_data();
  io.c0 = c0.typed_data();
  io.w_t = w_t.typed_data();
  io.dh_last = dh_last.typed_data();
  io.dc_last = dc_last.typed_data();
  io.dz = dz->typed_data();
  io.dh0 = dh0->typed_data();
  io.dc0 = dc0->typed_data();
  return io;
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
                        int64_t unit_parts, bool bf16) {
  Shape d;
  std::string why = WindowShape("gates", gates.dimensions(), &d);
  if (why.empty() && bf16 && !kBf16Matmul) why = kNoBf16;
  const std::string m = FirstMismatch(
      why, why.empty() ? BackwardMismatches(d, d_ys, cs, c0, w_t, dh_last,
                                            dc_last, dz, dh0, dc0)
                       : std::vector<std::string>{});
  if (!m.empty()) return Failed("zebra_native_backward: " + m);
  BackwardBuffers io = BackwardBuffersOf(d_ys, gates, cs, c0, w_t, dh_last,
                                         dc_last, dz, dh0, dc0);
  io.bf16 = bf16;
  return Guarded("zebra_native_backward", [&] {
    Backward(d, Clipped(threads), Clipped(unit_parts), &pool, io);
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
    int64_t unit_parts, bool bf16) {
  Shape d;
  std::string why = WindowShape("gates", gates.dimensions(), &d);
  if (why.empty() && bf16 && !kBf16Matmul) why = kNoBf16;
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
  BackwardBuffers io = BackwardBuffersOf(d_ys, gates, cs, c0, w_t, dh_last,
                                         dc_last, dz, dh0, dc0);
  io.bf16 = bf16;
  WeightGradBuffers grads;
  grads.ys = ys.typed_data();
  grads.h0 = h0.typed_data();
  grads.x = x.typed_data();
  grads.x_width = width;
  grads.dense = dense;
  grads.d_w_h = d_w_h->typed_data();
  grads.d_w_x = d_w_x->typed_data();
  grads.d_bias = d_bias->typed_data();
  return Guarded("zebra_native_backward_grads", [&] {
    Backward(d, Clipped(threads), Clipped(unit_parts), &pool, io, &grads);
  });
}

// C = op(A) op(B) in bf16 with float32 sums (bf16_matmul.h): a [m, k] or,
// transposed, [k, m]; b [k, n] or, transposed, [n, k]; c [m, n].
ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a,
                          ffi::Buffer<ffi::F32> b,
                          ffi::ResultBuffer<ffi::F32> c, bool a_transposed,
                          bool b_transposed, int64_t threads) {
  const char* name = "zebra_bf16_matmul";
  if (!kBf16Matmul)
    return Failed(std::string(name) + ": this library was built without "
                  "AVX512_BF16");
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2)
    return Failed(std::string(name) + ": a and b must be matrices");
  const int64_t m = a.dimensions()[a_transposed ? 1 : 0];
  const int64_t k = a.dimensions()[a_transposed ? 0 : 1];
  const int64_t n = b.dimensions()[b_transposed ? 0 : 1];
  const std::string why = FirstMismatch(
      "", {Mismatch("b", b, {b_transposed ? n : k, b_transposed ? k : n}),
           Mismatch("c", *c, {m, n})});
  if (!why.empty()) return Failed(std::string(name) + ": " + why);
#ifdef ZEBRA_BF16_MATMUL
  const Operand left{a.typed_data(), a.dimensions()[1], a_transposed};
  const Operand right{b.typed_data(), b.dimensions()[1], !b_transposed};
  return Guarded(name, [&] {
    Bf16Matmul(m, n, k, left, right, c->typed_data(), Clipped(threads),
               &pool);
  });
#else
  (void)pool, (void)threads;
  return ffi::Error::Success();
#endif
}

// The tied head's softmax cross-entropy by row chunks (fused_xent.h):
// h [N, H], e [V, H], b [V], targets [N] -> loss [N]; with_grads: d_h,
// d_e, d_b of the losses' sum times grad_scale, else those three empty;
// bf16: the products on the AVX512_BF16 units.
ffi::Error FusedXentImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h,
                         ffi::Buffer<ffi::F32> e, ffi::Buffer<ffi::F32> b,
                         ffi::Buffer<ffi::S32> targets,
                         ffi::ResultBuffer<ffi::F32> loss,
                         ffi::ResultBuffer<ffi::F32> d_h,
                         ffi::ResultBuffer<ffi::F32> d_e,
                         ffi::ResultBuffer<ffi::F32> d_b, bool with_grads,
                         bool bf16, int64_t chunk_rows, int64_t threads,
                         float grad_scale) {
  const std::string name = "zebra_fused_xent: ";
  if (bf16 && !kBf16Matmul)
    return Failed(name + "this library was built without AVX512_BF16");
  if (h.dimensions().size() != 2 || e.dimensions().size() != 2)
    return Failed(name + "h and e must be matrices");
  const int64_t n = h.dimensions()[0], width = h.dimensions()[1];
  const int64_t v = e.dimensions()[0];
  if (n > INT_MAX || v > INT_MAX || width > INT_MAX)
    return Failed(name + "a dimension out of range");
  if (chunk_rows <= 0 || chunk_rows % kPanel || chunk_rows > 4096)
    return Failed(name + "chunk_rows must be a multiple of " +
                  std::to_string(kPanel) + " in [" + std::to_string(kPanel) +
                  ", 4096]");
  std::vector<std::string> checks = {
      Mismatch("e", e, {v, width}), Mismatch("b", b, {v}),
      Mismatch("targets", targets, {n}), Mismatch("loss", *loss, {n})};
  if (with_grads)
    checks.insert(checks.end(), {Mismatch("d_h", *d_h, {n, width}),
                                 Mismatch("d_e", *d_e, {v, width}),
                                 Mismatch("d_b", *d_b, {v})});
  const std::string why = FirstMismatch("", checks);
  if (!why.empty()) return Failed(name + why);
  XentBuffers io;
  io.n = n;
  io.v = v;
  io.h = width;
  io.hidden = h.typed_data();
  io.e = e.typed_data();
  io.b = b.typed_data();
  io.targets = targets.typed_data();
  io.loss = loss->typed_data();
  io.grad_scale = grad_scale;
  if (with_grads) {
    io.d_h = d_h->typed_data();
    io.d_e = d_e->typed_data();
    io.d_b = d_b->typed_data();
  }
  return Guarded("zebra_fused_xent", [&] {
    FusedXent(io, int(chunk_rows), bf16, Clipped(threads), &pool);
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

// The build's record, read by native_check.py from the file before the
// library is loaded: the source it was built from (native_build.py passes
// its digest) and
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
                                  .Attr<int64_t>("unit_parts")
                                  .Attr<bool>("bf16"));

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
                                  .Attr<int64_t>("unit_parts")
                                  .Attr<bool>("bf16"));

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
                                  .Attr<int64_t>("unit_parts")
                                  .Attr<bool>("bf16"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZebraBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Ret<ffi::Buffer<ffi::F32>>()  // c
                                  .Attr<bool>("a_transposed")
                                  .Attr<bool>("b_transposed")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZebraFusedXent, FusedXentImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h
                                  .Arg<ffi::Buffer<ffi::F32>>()  // e
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Arg<ffi::Buffer<ffi::S32>>()  // targets
                                  .Ret<ffi::Buffer<ffi::F32>>()  // loss
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d_h
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d_e
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d_b
                                  .Attr<bool>("with_grads")
                                  .Attr<bool>("bf16")
                                  .Attr<int64_t>("chunk_rows")
                                  .Attr<int64_t>("threads")
                                  .Attr<float>("grad_scale"));
