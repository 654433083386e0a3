// Vector primitives of the LFF and encoding kernels, for one instruction set: compiled once
// per set inside a namespace that defines kBytes (see per_isa.h; no include guard, no
// system headers). Float lanes are W = kBytes / 4.
//
// - vfma: one rounding (an FMA instruction, or the C library's exact fmaf on the baseline
//   x86 target, which lacks one): the same bits on every instruction set.
// - vfloor: IEEE floor.
// - load / store with a lane count (row tails), and float32 <-> bfloat16 / float16
//   conversions rounding to nearest even (what Triton's round_to does).
// - The phase helpers of triton_kernels/_phase.py, operation for operation: frequencies in
//   turns as a float32 pair hi + lo, the phase as an unevaluated sum, the reduction to a
//   quarter turn and the same polynomials. Contraction is off here (per_isa.h), so every
//   product is rounded where Triton rounds it. position_sincos: the cos / sin of one
//   position's phases (LFF features and rotary kernels), from prepare_turns' tables.
// - Shared by the kernels of lff_cpu.cpp, encoding_cpu.cpp and rotary_cpu.cpp: channel
//   pairs (interleave / deinterleave), scalar loads of any storage dtype, and the ordered
//   sum of per-block partial sums (sum_partials, the deterministic weight gradients).

typedef float V __attribute__((vector_size(kBytes)));
typedef int32_t VI __attribute__((vector_size(kBytes)));
typedef uint32_t VU __attribute__((vector_size(kBytes)));
typedef uint16_t VH __attribute__((vector_size(kBytes / 2)));  // W 16-bit lanes
constexpr int W = kBytes / 4;
using Math = ::posenc_fast::floater::cpu::F32Math<kBytes>;

PF_INLINE V splat(float x) { return ::posenc_fast::floater::cpu::vsplat<V>(x); }
PF_INLINE V vload(const float* p) { return ::posenc_fast::floater::cpu::vload<V>(p); }
PF_INLINE void vstore(float* p, V v) { ::posenc_fast::floater::cpu::vstore(p, v); }
template <typename A, typename B>
PF_INLINE A bitcast(B b) {
  static_assert(sizeof(A) == sizeof(B), "bitcast between vectors of one size");
  A a;
  std::memcpy(&a, &b, sizeof(A));
  return a;
}

PF_INLINE V vfma(V a, V b, V c) {  // a * b + c, rounded once
#if defined(PF_X86) && PF_VEC_BYTES == 64
  return bitcast<V>(_mm512_fmadd_ps(bitcast<__m512>(a), bitcast<__m512>(b), bitcast<__m512>(c)));
#elif defined(PF_X86) && PF_VEC_BYTES == 32
  return bitcast<V>(_mm256_fmadd_ps(bitcast<__m256>(a), bitcast<__m256>(b), bitcast<__m256>(c)));
#elif defined(__aarch64__)
  return bitcast<V>(vfmaq_f32(bitcast<float32x4_t>(c), bitcast<float32x4_t>(a), bitcast<float32x4_t>(b)));
#else
  V r;
  for (int i = 0; i < W; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

PF_INLINE V vfloor(V x) {
#if defined(PF_X86) && PF_VEC_BYTES == 64
  return bitcast<V>(_mm512_roundscale_ps(bitcast<__m512>(x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#elif defined(PF_X86) && PF_VEC_BYTES == 32
  return bitcast<V>(_mm256_floor_ps(bitcast<__m256>(x)));
#elif defined(__aarch64__)
  return bitcast<V>(vrndmq_f32(bitcast<float32x4_t>(x)));
#else
  // |x| < 2^23: round to an integer by adding and removing 2^23 with x's sign, then step
  // down where that rounded up; larger |x|, inf and NaN are their own floor. Zero keeps
  // its sign, as floor does.
  const V big = splat(8388608.0f);
  const V ax = x < 0.0f ? -x : x;
  const V t = x < 0.0f ? -big : big;
  V r = (x + t) - t;
  r = r > x ? r - 1.0f : r;
  r = bitcast<V>(bitcast<VU>(r) | (bitcast<VU>(x) & 0x80000000u));  // -0.0 and (-1, 0) -> -0 / -1
  return ax < big ? r : x;
#endif
}

// --- loads and stores of n <= W lanes (tail lanes of a load are zero) ---------------------

PF_INLINE V load_n(const float* p, int n) {
  if (n >= W) return vload(p);
#if defined(PF_X86) && PF_VEC_BYTES == 64
  return bitcast<V>(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p));
#else
  V v{};
  std::memcpy(&v, p, sizeof(float) * n);
  return v;
#endif
}
PF_INLINE void store_n(float* p, V v, int n) {
  if (n >= W) {
    vstore(p, v);
    return;
  }
#if defined(PF_X86) && PF_VEC_BYTES == 64
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), bitcast<__m512>(v));
#else
  std::memcpy(p, &v, sizeof(float) * n);
#endif
}

// float32 -> bfloat16 bits, to nearest even; a NaN stays a (quiet) NaN.
PF_INLINE VU bf16_round(V v) {
  const VU u = bitcast<VU>(v);
  const VU r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return v != v ? (u | 0x400000u) >> 16 : r;
}

PF_INLINE V f16_to_f32(VH h) {
#if defined(PF_X86) && PF_VEC_BYTES == 64
  return bitcast<V>(_mm512_cvtph_ps(bitcast<__m256i>(h)));
#elif defined(PF_X86) && PF_VEC_BYTES == 32
  return bitcast<V>(_mm256_cvtph_ps(bitcast<__m128i>(h)));
#else
  V v;
  for (int i = 0; i < W; ++i) v[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
  return v;
#endif
}
PF_INLINE VH f32_to_f16(V v) {  // to nearest even
#if defined(PF_X86) && PF_VEC_BYTES == 64
  return bitcast<VH>(_mm512_cvtps_ph(bitcast<__m512>(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(PF_X86) && PF_VEC_BYTES == 32
  return bitcast<VH>(_mm256_cvtps_ph(bitcast<__m256>(v), _MM_FROUND_TO_NEAREST_INT));
#else
  VH h;
  for (int i = 0; i < W; ++i) h[i] = c10::Half(v[i]).x;
  return h;
#endif
}

// (whole vectors with a constant-size copy: one load / store, not a library memcpy call)
PF_INLINE VH load_h(const void* p, int n) {
  VH h{};
  if (n >= W)
    std::memcpy(&h, p, sizeof(VH));
  else
    std::memcpy(&h, p, sizeof(uint16_t) * n);
  return h;
}
PF_INLINE void store_h(void* p, VH h, int n) {
  if (n >= W)
    std::memcpy(p, &h, sizeof(VH));
  else
    std::memcpy(p, &h, sizeof(uint16_t) * n);
}

// n <= W values at element offset i of a row of dtype dt, as float32 (tail lanes zero).
template <DT dt>
PF_INLINE V load_as(const void* row, int64_t i, int n) {
  if (dt == DT::F32) return load_n(static_cast<const float*>(row) + i, n);
  const VH h = load_h(static_cast<const uint16_t*>(row) + i, n);
  if (dt == DT::F16) return f16_to_f32(h);
  return bitcast<V>(__builtin_convertvector(h, VU) << 16);
}
template <DT dt>
PF_INLINE void store_as(void* row, int64_t i, V v, int n) {
  if (dt == DT::F32) {
    store_n(static_cast<float*>(row) + i, v, n);
  } else {
    const VH h = dt == DT::F16 ? f32_to_f16(v) : __builtin_convertvector(bf16_round(v), VH);
    store_h(static_cast<uint16_t*>(row) + i, h, n);
  }
}

// Non-temporal ("streaming") store of a whole vector to an output row that is never read
// back here: no read-for-ownership of the line, no cache pollution (outputs of tens of MB).
// The address must be aligned to the stored width (64 / 32 bytes for float32 / 16-bit
// lanes on AVX-512, 32 / 16 on AVX2); the baseline code stores normally. fence() after.
template <DT dt>
PF_INLINE void stream_as(void* row, int64_t i, V v) {
#if defined(PF_X86) && PF_VEC_BYTES == 64
  if (dt == DT::F32) {
    _mm512_stream_ps(static_cast<float*>(row) + i, bitcast<__m512>(v));
  } else {
    const VH h = dt == DT::F16 ? f32_to_f16(v) : __builtin_convertvector(bf16_round(v), VH);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(row) + i), bitcast<__m256i>(h));
  }
#elif defined(PF_X86) && PF_VEC_BYTES == 32
  if (dt == DT::F32) {
    _mm256_stream_ps(static_cast<float*>(row) + i, bitcast<__m256>(v));
  } else {
    const VH h = dt == DT::F16 ? f32_to_f16(v) : __builtin_convertvector(bf16_round(v), VH);
    _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(row) + i), bitcast<__m128i>(h));
  }
#else
  store_as<dt>(row, i, v, W);
#endif
}
// Orders the streaming stores before whatever the thread does next (they are weakly ordered).
PF_INLINE void stream_fence() {
#if defined(PF_X86) && PF_VEC_BYTES >= 32
  _mm_sfence();
#endif
}

// Calls fn(tag) with tag a std::integral_constant<DT, dt> for the runtime dtype dt: one
// switch outside the loops, which are then compiled per dtype (decltype(tag)::value).
template <typename F>
PF_INLINE void with_dt(DT dt, const F& fn) {
  switch (dt) {
    case DT::F32:
      fn(std::integral_constant<DT, DT::F32>{});
      break;
    case DT::BF16:
      fn(std::integral_constant<DT, DT::BF16>{});
      break;
    default:
      fn(std::integral_constant<DT, DT::F16>{});
  }
}

// --- channel pairs ----------------------------------------------------------------------

// (a0, b0, a1, b1, ...) and its second half: the sinusoidal layout of W sines and cosines.
PF_INLINE void interleave(V a, V b, V& lo, V& hi) {
#if defined(__clang__)
  float t[2 * W];
  for (int i = 0; i < W; ++i) {
    t[2 * i] = a[i];
    t[2 * i + 1] = b[i];
  }
  lo = vload(t);
  hi = vload(t + W);
#else
  VI ml, mh;
  for (int i = 0; i < W / 2; ++i) {
    ml[2 * i] = i;
    ml[2 * i + 1] = W + i;
    mh[2 * i] = W / 2 + i;
    mh[2 * i + 1] = W + W / 2 + i;
  }
  lo = __builtin_shuffle(a, b, ml);
  hi = __builtin_shuffle(a, b, mh);
#endif
}
// The inverse: even lanes of (lo, hi) and odd lanes.
PF_INLINE void deinterleave(V lo, V hi, V& even, V& odd) {
#if defined(__clang__)
  float t[2 * W];
  vstore(t, lo);
  vstore(t + W, hi);
  for (int i = 0; i < W; ++i) {
    even[i] = t[2 * i];
    odd[i] = t[2 * i + 1];
  }
#else
  VI me, mo;
  for (int i = 0; i < W; ++i) {
    me[i] = 2 * i;
    mo[i] = 2 * i + 1;
  }
  even = __builtin_shuffle(lo, hi, me);
  odd = __builtin_shuffle(lo, hi, mo);
#endif
}

PF_INLINE float load_scalar(const void* p, int64_t i, DT dt) {
  if (dt == DT::F32) return static_cast<const float*>(p)[i];
  const uint16_t bits = static_cast<const uint16_t*>(p)[i];
  if (dt == DT::BF16) return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// --- phases (triton_kernels/_phase.py) ---------------------------------------------------

// 1/(2 pi) = kInv2PiHi + kInv2PiLo, each float32
constexpr float kInv2PiHi = 0.15915493667125702f;
constexpr float kInv2PiLo = 6.4206382432985265e-09f;

struct Phase {
  V hi, lo;  // turns, an unevaluated sum
};

// w radians per unit -> turns hi + lo (= w / 2 pi to ~2^-48)
PF_INLINE Phase turns_hi_lo(V w) {
  const V hi = w * kInv2PiHi;
  return Phase{hi, vfma(w, splat(kInv2PiHi), -hi) + w * kInv2PiLo};
}
// x * (t.hi + t.lo): hi = fl(x * t.hi), lo = its exact remainder + x * t.lo
PF_INLINE Phase phase_term(V x, const Phase& t) {
  const V p = x * t.hi;
  return Phase{p, vfma(x, t.hi, -p) + x * t.lo};
}
// s + x * t, keeping the sum unevaluated (two-sum of the leading parts)
PF_INLINE Phase accumulate_phase(const Phase& s, V x, const Phase& t) {
  const Phase p = phase_term(x, t);
  const V sum = s.hi + p.hi;
  const V bb = sum - s.hi;
  const V err = (s.hi - (sum - bb)) + (p.hi - bb);
  return Phase{sum, s.lo + (err + p.lo)};
}

// cos and sin of 2 pi (hi + lo): quarter turns removed exactly, |f| <= 1/8 turn, Taylor
// polynomials of sin(2 pi f) / f and cos(2 pi f) in f^2 (float32 coefficients), rotation.
PF_INLINE void sincos_turns(const Phase& ph, V& cos_out, V& sin_out) {
  const V q = vfloor(ph.hi * 4.0f + 0.5f);  // nearest quarter turn; hi * 4 is exact
  V f = (ph.hi - q * 0.25f) + ph.lo;         // hi - q/4 is exact: the only rounding
  const V q2 = vfloor(f * 4.0f + 0.5f);      // lo's quarter turns (huge phases only)
  f = f - q2 * 0.25f;
  V quad = (q - 4.0f * vfloor(q * 0.25f)) + q2;
  quad = quad - 4.0f * vfloor(quad * 0.25f);  // (q + q2) mod 4
  const V f2 = f * f;
  V sp = vfma(f2, splat(42.058692932128906f), splat(-76.70585632324219f));
  sp = vfma(f2, sp, splat(81.6052474975586f));
  sp = vfma(f2, sp, splat(-41.34170150756836f));
  sp = vfma(f2, sp, splat(6.2831854820251465f));
  const V s = f * sp;
  V cp = vfma(f2, splat(-26.42625617980957f), splat(60.2446403503418f));
  cp = vfma(f2, cp, splat(-85.45681762695312f));
  cp = vfma(f2, cp, splat(64.93939208984375f));
  cp = vfma(f2, cp, splat(-19.739208221435547f));
  const V c = vfma(f2, cp, splat(1.0f));
  const VI odd = (quad == 1.0f) | (quad == 3.0f);
  const V co = odd ? s : c;
  const V si = odd ? c : s;
  cos_out = ((quad == 1.0f) | (quad == 2.0f)) ? -co : co;
  sin_out = quad >= 2.0f ? -si : si;
}

// thi/tlo [M, ldt] = wr^T / (2 pi) as float32 pairs (turns_hi_lo), zero beyond F2;
// wr [F2, M] with row stride ldw.
inline void prepare_turns(const float* wr, int64_t F2, int64_t M, int64_t ldw, int64_t ldt, float* thi, float* tlo) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < ldt; k0 += W) {
      V w{};
      for (int i = 0; i < W && k0 + i < F2; ++i) w[i] = wr[(k0 + i) * ldw + m];
      const Phase t = turns_hi_lo(w);
      vstore(thi + m * ldt + k0, t.hi);
      vstore(tlo + m * ldt + k0, t.lo);
    }
}

// cos and sin of x . wr_k for the frequencies k0 .. k0 + W - 1 of one position x [M]
// (float32): phase_term for the first coordinate, accumulate_phase for the others, as
// triton_kernels/lff_forward.py's cos_sin_tile does. thi / tlo: prepare_turns' [M, ldt].
PF_INLINE void position_sincos(const float* x, int64_t M, const float* thi, const float* tlo, int64_t ldt,
                               int64_t k0, V& cs, V& sn) {
  Phase ph = phase_term(splat(x[0]), Phase{vload(thi + k0), vload(tlo + k0)});
  for (int64_t m = 1; m < M; ++m) ph = accumulate_phase(ph, splat(x[m]), Phase{vload(thi + m * ldt + k0), vload(tlo + m * ldt + k0)});
  sincos_turns(ph, cs, sn);
}

// --- reductions whose order does not depend on the vector width -------------------------
// Sums over a vectorised axis are kept in 16 "virtual lanes" (kRedLanes / W vectors), so
// that every instruction set adds the same numbers in the same order.
constexpr int kRedLanes = 16;
constexpr int kRedVecs = kRedLanes / W;
struct Red {
  V v[kRedVecs];
};
PF_INLINE float red_total(const Red& r) {  // lane 0 + lane 1 + ... + lane 15, in order
  float lanes[kRedLanes];
  std::memcpy(lanes, r.v, sizeof(lanes));
  float s = lanes[0];
  for (int i = 1; i < kRedLanes; ++i) s += lanes[i];
  return s;
}

// out[e] = parts[0][e] + parts[1][e] + ... (in this order) for e in [e0, e1), rounded to dt
// and written at out + e (dst_stride 1) -- or, for a transposed layout, element by element.
inline void sum_partials(const float* parts, int64_t nparts, int64_t stride, int64_t rows, int64_t cols, int64_t ld,
                  int64_t row0, int64_t row1, void* out, DT dt, int64_t ds_row, int64_t ds_col) {
  with_dt(dt, [&](auto tag) {
    constexpr DT odt = decltype(tag)::value;
    const int64_t esize = odt == DT::F32 ? 4 : 2;
    for (int64_t i = row0; i < row1 && i < rows; ++i)
      for (int64_t j = 0; j < cols; j += W) {
        const int n = static_cast<int>(cols - j < W ? cols - j : W);
        V s = load_n(parts + i * ld + j, n);
        for (int64_t b = 1; b < nparts; ++b) s += load_n(parts + b * stride + i * ld + j, n);
        if (ds_col == 1) {
          store_as<odt>(static_cast<char*>(out) + i * ds_row * esize, j, s, n);
        } else {
          for (int q = 0; q < n; ++q) {
            V one{};
            one[0] = s[q];
            store_as<odt>(static_cast<char*>(out) + (i * ds_row + (j + q) * ds_col) * esize, 0, one, 1);
          }
        }
      }
  });
}
