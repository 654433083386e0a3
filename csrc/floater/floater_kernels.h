// FLOATER integrator on the CPU: the kernels of one stage of a chunk of states, for one
// instruction set (floater_cpu.cpp holds the drivers and the entry points, and is this
// header's only includer: everything here has internal linkage).
//
// Shapes: a chunk of R states (padded to an even count), y [R, d], z / a [R, H], k [R, d];
// weights w1 [d+1, H], w2 [H+1, d] read through Panels (columns [c0, c1) of a matrix, or a
// packed copy of them). Each stage is two regions:
//   layer 1: Z = Y @ w1[:d] + (b1 + tau w1[d]), A = act(Z)          (over columns of H)
//   layer 2: K = A @ w2[:H] + (b2 + tau w2[H]), then the RK combination (over columns of d)
// and the backward's two regions go through the transposed products; Flush adds the weight
// gradients of many stages at once. Register tiles of up to 12 states x 2 vectors read each
// weight row once per tile.
// Instruction sets: the region kernels are compiled three times (AVX-512, AVX2+FMA,
// baseline) through target attributes, with the build's contraction (the sets agree within
// rounding, not bitwise as the LFF kernels do); kernels<T>() picks cpu/isa.h's choice.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/isa.h"
#include "cpu/vec.h"
#include "floater_common.h"

namespace posenc_fast {
namespace floater {
namespace {

using namespace ::posenc_fast::cpu;

constexpr int kTile = 4;  // states per remainder tile after the tiles of 6

template <typename T>
struct Dyn {
  const T* w1;  // [d+1, H]
  const T* b1;  // [H]
  const T* w2;  // [H+1, d]
  const T* b2;  // [d]
  int64_t d, H;
  Activation act;
  const T* zeros = nullptr;  // backward: the (absent) bias of the transposed products
};

// Columns [c0, c1) of a weight matrix, column c of row k at w[k * ld + (c - c0)]: a view of
// the matrix itself (w = matrix + c0, ld = its width) or a packed panel (ld = c1 - c0).
template <typename T>
struct Panel {
  const T* w;
  int64_t ld, c0, c1;
};

// One forward stage of a chunk.
template <typename T>
struct Fwd {
  Dyn<T> dyn;
  int64_t R;        // rows (states, padded to an even count)
  const T* y;       // [R, d] stage input
  const T* init1;   // [H]    b1 + tau * w1[d]
  T* z;             // [R, H] pre-activation
  T* a;             // [R, H] activation
  const T* init2;   // [d]    b2 + tau * w2[H]
  T* k;             // [R, d] this stage's slope
  // After K: dst = base + h * sum_j coef[j] * ks[j], column by column (ks may include k).
  T* dst;
  const T* base;
  const T* ks[kMaxStages];
  T coef[kMaxStages];
  int nk;
  T h;
};

// Backward through one stage of a chunk: given gk = dLoss/dK, produce gz and gy, then
// lam += gy and gks[j] += coef[j] * gy (weight gradients: later, many stages at once, Flush).
template <typename T>
struct Bwd {
  Dyn<T> dyn;
  int64_t R;
  T tau;
  const T* y;   // [R, d] stage input
  const T* z;   // [R, H]
  const T* a;   // [R, H]
  const T* gk;  // [R, d]
  T* gz;        // [R, H]
  T* gy;        // [R, d]
  T* lam;       // [R, d]
  T* gks[kMaxStages];
  T coef[kMaxStages];
  int nk;
};

// --- Micro-kernels (always_inline: compiled inside each instruction-set wrapper below)

// Row tiles: the accumulators of RT states x 2 vectors stay in registers, so each weight
// row is read once per RT states: RT = 12 with AVX-512's 32 registers, 6 with 16.
template <typename T, int B>
constexpr int max_row_tile() {
  return B >= 64 ? 12 : 6;
}

// out[r, c] = init[c] + sum_k x[r, k] * w[k, c]   for r < RT, c in [c0, c1)
// (ACC: out[r, c] += sum_k ..., the sum starting from out's own value.)
// x [RT, K] (row stride ldx), w row stride ldw, out row stride ldo. Each element is the same
// left-to-right sum in every code path (full block, single vector, partial vector) and
// for every RT.
template <typename T, int B, int RT, bool ACC = false>
PF_INLINE void mm_nn_tile(const T* xr, int64_t ldx, int64_t K, const T* w, int64_t ldw, const T* init,
                          int64_t c0, int64_t c1, T* orow, int64_t ldo) {
  using V = typename VecT<T, B>::type;
  constexpr int W = VecT<T, B>::lanes;
  int64_t c = c0;
  for (; c + 2 * W <= c1; c += 2 * W) {
    V acc[RT][2];
    if (ACC) {
      for (int s = 0; s < RT; ++s) {
        acc[s][0] = vload<V>(orow + s * ldo + c);
        acc[s][1] = vload<V>(orow + s * ldo + c + W);
      }
    } else {
      const V i0 = vload<V>(init + c), i1 = vload<V>(init + c + W);
      for (int s = 0; s < RT; ++s) {
        acc[s][0] = i0;
        acc[s][1] = i1;
      }
    }
    const T* wk = w + c;
    for (int64_t k = 0; k < K; ++k, wk += ldw) {
      const V w0 = vload<V>(wk), w1 = vload<V>(wk + W);
      for (int s = 0; s < RT; ++s) {
        const V xs = vsplat<V>(xr[s * ldx + k]);
        acc[s][0] += xs * w0;
        acc[s][1] += xs * w1;
      }
    }
    for (int s = 0; s < RT; ++s) {
      vstore(orow + s * ldo + c, acc[s][0]);
      vstore(orow + s * ldo + c + W, acc[s][1]);
    }
  }
  for (; c < c1; c += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, c1 - c));
    V acc[RT];
    for (int s = 0; s < RT; ++s) acc[s] = ACC ? vload_n<V>(orow + s * ldo + c, n) : vload_n<V>(init + c, n);
    const T* wk = w + c;
    for (int64_t k = 0; k < K; ++k, wk += ldw) {
      const V w0 = vload_n<V>(wk, n);
      for (int s = 0; s < RT; ++s) acc[s] += vsplat<V>(xr[s * ldx + k]) * w0;
    }
    for (int s = 0; s < RT; ++s) vstore_n(orow + s * ldo + c, acc[s], n);
  }
}

// The same over any R rows, in tiles of 12, 8 (AVX-512), 6, 4, 2, then 1 rows (6: 15 of
// the 16 AVX2 registers; benchmarks/NOTES.md, "FLOATER integrator on the CPU", 6).
// Long reductions are cut into blocks of kKBlock rows of w, partial sums parked in out
// (L1), so that w is read in contiguous row blocks the prefetchers stream. Each element's
// sum keeps its order: bitwise the same result.
constexpr int64_t kKBlock = 128;

template <typename T, int B, bool ACC>
PF_INLINE void mm_nn_rows(const T* x, int64_t ldx, int64_t K, int64_t R, const T* w, int64_t ldw,
                          const T* init, int64_t c0, int64_t c1, T* out, int64_t ldo) {
  int64_t r = 0;
  if (max_row_tile<T, B>() >= 12) {
    for (; R - r >= 12; r += 12)
      mm_nn_tile<T, B, 12, ACC>(x + r * ldx, ldx, K, w, ldw, init, c0, c1, out + r * ldo, ldo);
    if (R - r >= 8) {
      mm_nn_tile<T, B, 8, ACC>(x + r * ldx, ldx, K, w, ldw, init, c0, c1, out + r * ldo, ldo);
      r += 8;
    }
  }
  for (; R - r >= 6; r += 6)
    mm_nn_tile<T, B, 6, ACC>(x + r * ldx, ldx, K, w, ldw, init, c0, c1, out + r * ldo, ldo);
  for (; R - r >= kTile; r += kTile)
    mm_nn_tile<T, B, kTile, ACC>(x + r * ldx, ldx, K, w, ldw, init, c0, c1, out + r * ldo, ldo);
  if (R - r >= 2) {
    mm_nn_tile<T, B, 2, ACC>(x + r * ldx, ldx, K, w, ldw, init, c0, c1, out + r * ldo, ldo);
    r += 2;
  }
  for (; r < R; ++r) mm_nn_tile<T, B, 1, ACC>(x + r * ldx, ldx, K, w, ldw, init, c0, c1, out + r * ldo, ldo);
}

template <typename T, int B>
PF_INLINE void mm_nn(const T* x, int64_t K, int64_t R, const T* w, int64_t ldw, const T* init,
                     int64_t c0, int64_t c1, T* out, int64_t ldo) {
  const int64_t k1 = std::min(K, kKBlock);
  mm_nn_rows<T, B, false>(x, K, k1, R, w, ldw, init, c0, c1, out, ldo);
  for (int64_t k0 = k1; k0 < K; k0 += kKBlock)
    mm_nn_rows<T, B, true>(x + k0, K, std::min(kKBlock, K - k0), R, w + k0 * ldw, ldw, nullptr, c0, c1, out, ldo);
}

// out[j, c] += sum_k x[j, k] * w[k, c] for any number of rows R: the weight-gradient
// update dW += X^T G with x = X^T (blocked over k like mm_nn).
template <typename T, int B>
PF_INLINE void mm_nn_acc(const T* x, int64_t K, int64_t R, const T* w, int64_t ldw, int64_t c0, int64_t c1,
                         T* out, int64_t ldo) {
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock)
    mm_nn_rows<T, B, true>(x + k0, K, std::min(kKBlock, K - k0), R, w + k0 * ldw, ldw, nullptr, c0, c1, out, ldo);
}

// Activations over a contiguous row segment. float32: vectorised polynomials (cpu/vec.h);
// float64: libm (exact to the last bits, speed is secondary there).
template <typename T, int B>
struct Act;

template <int B>
struct Act<float, B> {
  using M = F32Math<B>;
  using V = typename M::V;
  static constexpr int W = VecT<float, B>::lanes;

  static PF_INLINE V fwd(Activation act, V z) {
    switch (act) {
      case Activation::ReLU:
        return z < 0.0f ? vsplat<V>(0.0f) : z;
      case Activation::Tanh:
        return M::tanh(z);
      case Activation::GELU:
        return z * M::normal_cdf(z);
      default:
        return z;
    }
  }
  static PF_INLINE V bwd(Activation act, V z, V a, V ga) {
    switch (act) {
      case Activation::ReLU:
        return z > 0.0f ? ga : vsplat<V>(0.0f);
      case Activation::Tanh:
        return ga * (1.0f - a * a);
      case Activation::GELU:
        return ga * (M::normal_cdf(z) + z * M::normal_pdf(z));
      default:
        return ga;
    }
  }
  static PF_INLINE void forward(Activation act, const float* z, float* a, int64_t n) {
    if (act == Activation::Identity) {
      std::memcpy(a, z, sizeof(float) * n);
      return;
    }
    for (int64_t i = 0; i < n; i += W) {
      const int m = static_cast<int>(std::min<int64_t>(W, n - i));
      vstore_n(a + i, fwd(act, vload_n<V>(z + i, m)), m);
    }
  }
  // gz = ga * act'(z), in place over ga allowed
  static PF_INLINE void backward(Activation act, const float* z, const float* a, const float* ga,
                                 float* gz, int64_t n) {
    for (int64_t i = 0; i < n; i += W) {
      const int m = static_cast<int>(std::min<int64_t>(W, n - i));
      vstore_n(gz + i, bwd(act, vload_n<V>(z + i, m), vload_n<V>(a + i, m), vload_n<V>(ga + i, m)), m);
    }
  }
};

template <int B>
struct Act<double, B> {
  static PF_INLINE double cdf(double z) { return 0.5 * std::erfc(-z * 0.70710678118654752440); }
  static PF_INLINE double pdf(double z) { return std::exp(-0.5 * z * z) * 0.39894228040143267794; }
  static PF_INLINE void forward(Activation act, const double* z, double* a, int64_t n) {
    switch (act) {
      case Activation::ReLU:
        for (int64_t i = 0; i < n; ++i) a[i] = z[i] < 0.0 ? 0.0 : z[i];
        break;
      case Activation::Tanh:
        for (int64_t i = 0; i < n; ++i) a[i] = std::tanh(z[i]);
        break;
      case Activation::GELU:
        for (int64_t i = 0; i < n; ++i) a[i] = z[i] * cdf(z[i]);
        break;
      default:
        std::memcpy(a, z, sizeof(double) * n);
    }
  }
  static PF_INLINE void backward(Activation act, const double* z, const double* a, const double* ga,
                                 double* gz, int64_t n) {
    switch (act) {
      case Activation::ReLU:
        for (int64_t i = 0; i < n; ++i) gz[i] = z[i] > 0.0 ? ga[i] : 0.0;
        break;
      case Activation::Tanh:
        for (int64_t i = 0; i < n; ++i) gz[i] = ga[i] * (1.0 - a[i] * a[i]);
        break;
      case Activation::GELU:
        for (int64_t i = 0; i < n; ++i) gz[i] = ga[i] * (cdf(z[i]) + z[i] * pdf(z[i]));
        break;
      default:
        for (int64_t i = 0; i < n; ++i) gz[i] = ga[i];
    }
  }
};

// dst[r, c] = base[r, c] + h * sum_j coef[j] * ks[j][r, c], over c in [c0, c1), rows < R
template <typename T, int B>
PF_INLINE void combine(T* dst, const T* base, const T* const* ks, const T* coef, int nk, T h,
                       int64_t R, int64_t ld, int64_t c0, int64_t c1) {
  using V = typename VecT<T, B>::type;
  constexpr int W = VecT<T, B>::lanes;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t o = r * ld;
    for (int64_t c = c0; c < c1; c += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, c1 - c));
      V s = vload_n<V>(ks[0] + o + c, n) * coef[0];
      for (int j = 1; j < nk; ++j) s += vload_n<V>(ks[j] + o + c, n) * coef[j];
      vstore_n(dst + o + c, vload_n<V>(base + o + c, n) + h * s, n);
    }
  }
}

// --- Region kernels ----------------------------------------------------------------------

template <typename T, int B>
constexpr int64_t col_block() {
  return 2 * VecT<T, B>::lanes;
}

// Each region kernel computes the columns of one weight panel p (for every row). The
// products start their column index at 0 with every column-indexed pointer shifted by
// p.c0, so a panel view and a packed panel go through the same code. Every element is the
// same sum whatever the panel's bounds (mm_nn), so results do not depend on the panels.

// Layer 1 over a panel of w1[:d] (columns of H).
template <typename T, int B>
PF_INLINE void layer1_impl(const Fwd<T>& f, const Panel<T>& p) {
  const int64_t H = f.dyn.H, d = f.dyn.d, c0 = p.c0, n = p.c1 - p.c0;
  mm_nn<T, B>(f.y, d, f.R, p.w, p.ld, f.init1 + c0, 0, n, f.z + c0, H);
  for (int64_t r = 0; r < f.R; ++r) Act<T, B>::forward(f.dyn.act, f.z + r * H + c0, f.a + r * H + c0, n);
}

// Layer 2 and the RK combination over a panel of w2[:H] (columns of d).
template <typename T, int B>
PF_INLINE void layer2_impl(const Fwd<T>& f, const Panel<T>& p) {
  const int64_t H = f.dyn.H, d = f.dyn.d, c0 = p.c0, n = p.c1 - p.c0;
  mm_nn<T, B>(f.a, H, f.R, p.w, p.ld, f.init2 + c0, 0, n, f.k + c0, d);
  combine<T, B>(f.dst, f.base, f.ks, f.coef, f.nk, f.h, f.R, d, c0, p.c1);
}

// Backward region 1 over a panel of w2T = w2[:H]^T ([d, H], columns of H): gz.
template <typename T, int B>
PF_INLINE void bwd1_impl(const Bwd<T>& g, const Panel<T>& p) {
  const int64_t H = g.dyn.H, d = g.dyn.d, R = g.R, j0 = p.c0, n = p.c1 - p.c0;
  // ga = gk @ w2T  (into gz, then scaled by act')
  mm_nn<T, B>(g.gk, d, R, p.w, p.ld, g.dyn.zeros, 0, n, g.gz + j0, H);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t o = r * H + j0;
    Act<T, B>::backward(g.dyn.act, g.z + o, g.a + o, g.gz + o, g.gz + o, n);
  }
}

// Backward region 2 over a panel of w1T = w1[:d]^T ([H, d], columns of d): gy, then the
// adjoint combination.
template <typename T, int B>
PF_INLINE void bwd2_impl(const Bwd<T>& g, const Panel<T>& p) {
  using V = typename VecT<T, B>::type;
  constexpr int W = VecT<T, B>::lanes;
  const int64_t H = g.dyn.H, d = g.dyn.d, R = g.R, c0 = p.c0, c1 = p.c1;
  // gy = gz @ w1T
  mm_nn<T, B>(g.gz, H, R, p.w, p.ld, g.dyn.zeros, 0, c1 - c0, g.gy + c0, d);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t o = r * d;
    for (int64_t c = c0; c < c1; c += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, c1 - c));
      const V gy = vload_n<V>(g.gy + o + c, n);
      vstore_n(g.lam + o + c, vload_n<V>(g.lam + o + c, n) + gy, n);
      for (int j = 0; j < g.nk; ++j) {
        T* q = g.gks[j] + o + c;
        vstore_n(q, vload_n<V>(q, n) + g.coef[j] * gy, n);
      }
    }
  }
}

// Weight gradients of many stages at once: R rows, one per (step, stage, state).
//   dw1[:d] += Y^T GZ, dw1[d] += tau^T GZ, db1 += 1^T GZ, and the same for dw2 with A, GK,
// as products out += xt @ g with xt = [Y^T; tau; 1] ([d+2, R]) and [A^T; tau; 1] ([H+2, R]).
// Units: rows [0, d+2) of the first product, then [d+2, d+H+4) of the second. Each
// output row is owned by one thread and summed over the R rows in order (determinism).
template <typename T>
struct Flush {
  int64_t R, d, H;
  const T* xt1;  // [d+2, R]
  const T* xt2;  // [H+2, R]
  const T* gz;   // [R, H]
  const T* gk;   // [R, d]
  T *dw1, *db1, *dw2, *db2;  // accumulators (nullptr: not needed)
};

template <typename T, int B>
PF_INLINE void flush_rows(const T* xt, int64_t R, const T* g, int64_t N, int64_t rows, T* w, T* b, int64_t u0,
                          int64_t u1) {
  // rows [0, rows+1) of xt update w (its time row included), row rows+1 updates b
  const int64_t wend = std::min(u1, rows + 1);
  if (w && u0 < wend) mm_nn_acc<T, B>(xt + u0 * R, R, wend - u0, g, N, 0, N, w + u0 * N, N);
  if (b && u0 <= rows + 1 && rows + 1 < u1) mm_nn_acc<T, B>(xt + (rows + 1) * R, R, 1, g, N, 0, N, b, N);
}

template <typename T, int B>
PF_INLINE void flush_impl(const Flush<T>& f, int64_t u0, int64_t u1) {
  const int64_t d = f.d, H = f.H, n1 = d + 2;
  if (u0 < n1) flush_rows<T, B>(f.xt1, f.R, f.gz, H, d, f.dw1, f.db1, u0, std::min(u1, n1));
  if (u1 > n1) flush_rows<T, B>(f.xt2, f.R, f.gk, d, H, f.dw2, f.db2, std::max(u0, n1) - n1, u1 - n1);
}

template <typename T>
struct Kernels {
  const char* isa;
  int64_t block;  // columns per block: team members split the columns at these bounds
  void (*layer1)(const Fwd<T>&, const Panel<T>&);
  void (*layer2)(const Fwd<T>&, const Panel<T>&);
  void (*bwd1)(const Bwd<T>&, const Panel<T>&);
  void (*bwd2)(const Bwd<T>&, const Panel<T>&);
  void (*flush)(const Flush<T>&, int64_t, int64_t);
  void (*activate)(Activation, const T*, T*, int64_t);  // a = act(z) over n elements (layer 1's)
};

#define PF_ISA_WRAPPERS(NAME, ATTR, BYTES)                                                   \
  template <typename T>                                                                       \
  ATTR void layer1_##NAME(const Fwd<T>& f, const Panel<T>& p) {                               \
    layer1_impl<T, BYTES>(f, p);                                                              \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTR void layer2_##NAME(const Fwd<T>& f, const Panel<T>& p) {                               \
    layer2_impl<T, BYTES>(f, p);                                                              \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTR void bwd1_##NAME(const Bwd<T>& g, const Panel<T>& p) {                                 \
    bwd1_impl<T, BYTES>(g, p);                                                                \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTR void bwd2_##NAME(const Bwd<T>& g, const Panel<T>& p) {                                 \
    bwd2_impl<T, BYTES>(g, p);                                                                \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTR void flush_##NAME(const Flush<T>& f, int64_t u0, int64_t u1) {                         \
    flush_impl<T, BYTES>(f, u0, u1);                                                          \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTR void activate_##NAME(Activation act, const T* z, T* a, int64_t n) {                    \
    Act<T, BYTES>::forward(act, z, a, n);                                                     \
  }                                                                                           \
  template <typename T>                                                                       \
  Kernels<T> kernels_##NAME() {                                                               \
    return Kernels<T>{#NAME,           col_block<T, BYTES>(), &layer1_##NAME<T>, &layer2_##NAME<T>, \
                      &bwd1_##NAME<T>, &bwd2_##NAME<T>,       &flush_##NAME<T>,  &activate_##NAME<T>}; \
  }

#if defined(__x86_64__) || defined(_M_X64)
#define PF_HAVE_X86_ISAS 1
// 64-byte vectors in one zmm register; the compiler keeps 8 accumulators of a tile.
PF_ISA_WRAPPERS(avx512, __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,bmi2"))), 64)
PF_ISA_WRAPPERS(avx2, __attribute__((target("avx2,fma,bmi2"))), 32)
PF_ISA_WRAPPERS(generic, , 16)
#else
PF_ISA_WRAPPERS(generic, , 16)
#endif

template <typename T>
Kernels<T> kernels() {
#if defined(PF_HAVE_X86_ISAS)
  switch (isa_level()) {
    case 2:
      return kernels_avx512<T>();
    case 1:
      return kernels_avx2<T>();
    default:
      return kernels_generic<T>();
  }
#else
  return kernels_generic<T>();
#endif
}

}  // namespace
}  // namespace floater
}  // namespace posenc_fast
