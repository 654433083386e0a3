// Portable SIMD of the CPU runtime: GNU vector extensions (GCC, Clang), width-generic
// (VecT<T, B> is B bytes of T), and the float32 transcendental functions (F32Math) of the
// activations. Compiled once per instruction set inside the callers: FLOATER's kernels
// through target attributes (floater_kernels.h), the LFF / encoding / rotary kernels through
// cpu/per_isa.h (whose simd.h builds on these helpers), so one binary runs the AVX-512,
// AVX2 or baseline code that the machine supports (cpu/isa.h).
//
// Every helper is always_inline: it must be compiled inside the target-specific caller,
// never as a baseline out-of-line copy.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if !defined(__GNUC__)
#error "posenc_fast's C++ CPU kernels need GCC or Clang (GNU vector extensions)"
#endif

#define PF_INLINE inline __attribute__((always_inline))

namespace posenc_fast {
namespace cpu {

template <typename T, int B>
struct VecT {
  typedef T type __attribute__((vector_size(B)));
  static constexpr int lanes = B / static_cast<int>(sizeof(T));
};
template <int B>
struct IntVecT {
  typedef int32_t type __attribute__((vector_size(B)));
};

template <typename V>
PF_INLINE V vload(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));  // unaligned vector load
  return v;
}
template <typename V>
PF_INLINE void vstore(void* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}
template <typename V, typename T>
PF_INLINE V vsplat(T x) {
  // Through the integer bits: 0 + bits is an exact identity, so the compiler emits a bare
  // broadcast (GCC 12 compiles V{} + x and {x, x, ...} into worse code: 0 + -0.0 is +0.0).
  using U = typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type;
  typedef U VU __attribute__((vector_size(sizeof(V))));
  U bits;
  std::memcpy(&bits, &x, sizeof(T));
  const VU vu = VU{} + bits;
  V v;
  std::memcpy(&v, &vu, sizeof(V));
  return v;
}
// Load/store of n <= lanes elements (zero-filled), for row tails that must go through the
// same vector code as the rest of the row. A full vector (n == lanes) takes a plain vector
// load/store: a memcpy of a run-time length is a call into libc (GCC 12 does not inline it),
// too slow for the RK combination, whose every vector goes through here.
template <typename V, typename T>
PF_INLINE V vload_n(const T* p, int n) {
  if (n == static_cast<int>(sizeof(V) / sizeof(T))) return vload<V>(p);
  V v{};
  std::memcpy(&v, p, sizeof(T) * n);
  return v;
}
template <typename V, typename T>
PF_INLINE void vstore_n(T* p, V v, int n) {
  if (n == static_cast<int>(sizeof(V) / sizeof(T))) {
    vstore(p, v);
    return;
  }
  std::memcpy(p, &v, sizeof(T) * n);
}
// Sum of the lanes in a fixed order (the same on every run).
template <typename T, typename V>
PF_INLINE T vsum(V v) {
  constexpr int n = sizeof(V) / sizeof(T);
  T s = v[0];
  for (int i = 1; i < n; ++i) s += v[i];
  return s;
}

// --- float32 transcendental functions, vectorised (glibc's scalar tanhf / erff cost more
// than the two small matvecs of a stage at d = 64). Coefficients: tools/fit_float_math.py;
// max error about 2 ulp (tanh), 1.5e-7 absolute (erf). NaN propagates.
template <int B>
struct F32Math {
  using V = typename VecT<float, B>::type;
  using VI = typename IntVecT<B>::type;

  // exp(x) for x in [-86, 88] (callers clamp): Cody-Waite reduction x = n ln2 + r,
  // |r| <= ln2/2, Taylor series to r^7 (truncation < 1e-8 relative), scale by 2^n
  // through the exponent bits.
  static PF_INLINE V exp_clamped(V x) {
    const V t = x * 1.44269504088896341f;
    // round to nearest through the 2^23 + 2^22 trick (|t| < 2^22)
    const V n = (t + 12582912.0f) - 12582912.0f;
    V r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    V p = vsplat<V>(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const VI ni = __builtin_convertvector(n, VI);
    VI bits;
    std::memcpy(&bits, &p, sizeof(V));
    bits += ni << 23;
    V out;
    std::memcpy(&out, &bits, sizeof(V));
    return out;
  }

  static PF_INLINE V vabs(V x) { return x < 0.0f ? -x : x; }
  static PF_INLINE V vmin(V x, float m) { return x > m ? vsplat<V>(m) : x; }
  static PF_INLINE V vmax(V x, float m) { return x < m ? vsplat<V>(m) : x; }
  static PF_INLINE V keep_nan(V x, V r) { return x != x ? x : r; }

  static PF_INLINE V tanh(V x) {
    const V ax = vabs(x);
    const V x2 = x * x;
    V p = vsplat<V>(-0.0046791253f);
    p = p * x2 + 0.007714637f;
    p = p * x2 - 0.010684479f;
    p = p * x2 + 0.022228494f;
    p = p * x2 - 0.05399876f;
    p = p * x2 + 0.13333414f;
    p = p * x2 - 0.33333334f;
    const V small = x + x * x2 * p;
    // |x| >= 0.625: (1 - e) / (1 + e) with e = exp(-2|x|); tanh(9) == 1 in float32
    const V e = exp_clamped(-2.0f * vmin(ax, 9.0f));
    V big = (1.0f - e) / (1.0f + e);
    big = x < 0.0f ? -big : big;
    return keep_nan(x, ax < 0.625f ? small : big);
  }

  // erfc(u) * exp(u^2) for u in [1, 4]
  static PF_INLINE V erfcx_1_4(V u) {
    const V s = u - 2.5f;
    V q = vsplat<V>(-3.9718455e-07f);
    q = q * s + 1.6645055e-06f;
    q = q * s - 3.926866e-06f;
    q = q * s + 1.4394359e-05f;
    q = q * s - 5.9123595e-05f;
    q = q * s + 0.00021289282f;
    q = q * s - 0.0007335407f;
    q = q * s + 0.002466045f;
    q = q * s - 0.008001541f;
    q = q * s + 0.024938187f;
    q = q * s - 0.074347354f;
    q = q * s + 0.21080635f;
    return q;
  }
  static PF_INLINE V erf_small(V x) {  // |x| < 1
    const V x2 = x * x;
    V p = vsplat<V>(-9.641871e-06f);
    p = p * x2 + 0.000112570815f;
    p = p * x2 - 0.0008482849f;
    p = p * x2 + 0.005220947f;
    p = p * x2 - 0.0268654f;
    p = p * x2 + 0.11283782f;
    p = p * x2 - 0.37612638f;
    p = p * x2 + 1.1283792f;
    return x * p;
  }
  // erfc(|u|) for |u| >= 1 (clamped at 4, where erf(u) == +-1 in float32)
  static PF_INLINE V erfc_big(V au) {
    const V a = vmin(au, 4.0f);
    return exp_clamped(-(a * a)) * erfcx_1_4(a);
  }
  // Phi(z) = (1 + erf(z / sqrt 2)) / 2, without cancellation in the left tail
  static PF_INLINE V normal_cdf(V z) {
    const V u = z * 0.70710678118654752f;
    const V au = vabs(u);
    const V tail = 0.5f * erfc_big(au);  // upper tail probability for |u| >= 1
    const V mid = 0.5f + 0.5f * erf_small(u);
    const V big = u < 0.0f ? tail : 1.0f - tail;
    return keep_nan(z, au < 1.0f ? mid : big);
  }
  // Standard normal density; exactly 0 beyond |z| = 13 (below float32's range anyway).
  static PF_INLINE V normal_pdf(V z) {
    const V az = vabs(z);
    const V e = exp_clamped(-0.5f * vmin(az * az, 169.0f));
    return keep_nan(z, az > 13.0f ? vsplat<V>(0.0f) : e * 0.3989422804014327f);
  }
};

}  // namespace cpu
}  // namespace posenc_fast
