// Vector primitives of the per-instruction-set kernels (LFF, encodings, rotary), for one
// instruction set: compiled once per set inside a namespace that defines kBytes (see
// cpu/per_isa.h; no include guard, no system headers). Float lanes are W = kBytes / 4.
//
// vfma (one rounding: an FMA instruction, or the exact fmaf on the baseline x86 target),
// vfloor, loads / stores with a lane count, float32 <-> bfloat16 / float16 rounding to
// nearest even (as Triton's round_to), streaming stores, with_dt, channel pairs, scalar
// loads of any storage dtype, and the reductions whose order does not depend on the vector
// width (16 virtual lanes, sum_partials). On aarch64 the generic set is one 16-byte NEON
// register (FMLA, FRINTM, FCVTL / FCVTN; GNU vectors for the rest).

using ::posenc_fast::cpu::DT;
using ::posenc_fast::cpu::PartialSum;

typedef float V __attribute__((vector_size(kBytes)));
typedef int32_t VI __attribute__((vector_size(kBytes)));
typedef uint32_t VU __attribute__((vector_size(kBytes)));
typedef uint16_t VH __attribute__((vector_size(kBytes / 2)));  // W 16-bit lanes
constexpr int W = kBytes / 4;
using Math = ::posenc_fast::cpu::F32Math<kBytes>;

PF_INLINE V splat(float x) { return ::posenc_fast::cpu::vsplat<V>(x); }
PF_INLINE V vload(const float* p) { return ::posenc_fast::cpu::vload<V>(p); }
PF_INLINE void vstore(float* p, V v) { ::posenc_fast::cpu::vstore(p, v); }
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
// AVX-512 masks the tail; elsewhere vec.h's vload_n / vstore_n (n >= W: a whole vector).

PF_INLINE V load_n(const float* p, int n) {
#if defined(PF_X86) && PF_VEC_BYTES == 64
  if (n < W) return bitcast<V>(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p));
#endif
  return ::posenc_fast::cpu::vload_n<V>(p, n < W ? n : W);
}
PF_INLINE void store_n(float* p, V v, int n) {
#if defined(PF_X86) && PF_VEC_BYTES == 64
  if (n < W) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), bitcast<__m512>(v));
    return;
  }
#endif
  ::posenc_fast::cpu::vstore_n(p, v, n < W ? n : W);
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
#elif defined(__aarch64__)
  // FCVTL: the conversion c10::Half itself uses on aarch64 (a float16_t cast), 4 lanes at once
  return bitcast<V>(vcvt_f32_f16(bitcast<float16x4_t>(h)));
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
#elif defined(__aarch64__)
  // FCVTN, rounding to nearest even (the FPCR default), as c10::Half's float16_t cast does
  return bitcast<VH>(vcvt_f16_f32(bitcast<float32x4_t>(v)));
#else
  VH h;
  for (int i = 0; i < W; ++i) h[i] = c10::Half(v[i]).x;
  return h;
#endif
}

// The W 16-bit values of h (bfloat16 or float16 bits) as float32, and back (to nearest
// even): the only conversions of 16-bit storage in the kernels.
template <DT dt>
PF_INLINE V widen(VH h) {
  return dt == DT::F16 ? f16_to_f32(h) : bitcast<V>(__builtin_convertvector(h, VU) << 16);
}
template <DT dt>
PF_INLINE VH narrow(V v) {
  return dt == DT::F16 ? f32_to_f16(v) : __builtin_convertvector(bf16_round(v), VH);
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
  return widen<dt>(load_h(static_cast<const uint16_t*>(row) + i, n));
}
template <DT dt>
PF_INLINE void store_as(void* row, int64_t i, V v, int n) {
  if (dt == DT::F32)
    store_n(static_cast<float*>(row) + i, v, n);
  else
    store_h(static_cast<uint16_t*>(row) + i, narrow<dt>(v), n);
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
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(row) + i), bitcast<__m256i>(narrow<dt>(v)));
  }
#elif defined(PF_X86) && PF_VEC_BYTES == 32
  if (dt == DT::F32) {
    _mm256_stream_ps(static_cast<float*>(row) + i, bitcast<__m256>(v));
  } else {
    _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(row) + i), bitcast<__m128i>(narrow<dt>(v)));
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

// v into lanes j.. of an output row: a whole vector of an output written with streaming
// stores (cpu/tensors.h: use_streaming) by a streaming store, anything else stored.
template <DT dt>
PF_INLINE void put(void* row, int64_t j, V v, int n, bool stream) {
  if (stream && n == W)
    stream_as<dt>(row, j, v);
  else
    store_as<dt>(row, j, v, n);
}
// row[0, width) = value(j, n) for the vectors of lanes j .. j + n - 1 (put; stream_fence()
// after the last row).
template <DT dt, typename F>
PF_INLINE void write_row(void* row, int64_t width, bool stream, const F& value) {
  for (int64_t j = 0; j < width; j += W) {
    const int n = static_cast<int>(width - j < W ? width - j : W);
    put<dt>(row, j, value(j, n), n, stream);
  }
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

// Rows [row0, row1) of the sum s (cpu/parallel.h): parts[0] + parts[1] + ... in this
// order, rounded to s.dt; a whole vector per store where the output's columns are
// contiguous, else element by element (a transposed layout).
inline void sum_partials(const float* parts, int64_t nparts, int64_t stride, const PartialSum& s, int64_t row0,
                         int64_t row1) {
  with_dt(s.dt, [&](auto tag) {
    constexpr DT odt = decltype(tag)::value;
    const int64_t esize = odt == DT::F32 ? 4 : 2;
    for (int64_t i = row0; i < row1 && i < s.rows; ++i)
      for (int64_t j = 0; j < s.cols; j += W) {
        const int n = static_cast<int>(s.cols - j < W ? s.cols - j : W);
        V v = load_n(parts + i * s.ld + j, n);
        for (int64_t b = 1; b < nparts; ++b) v += load_n(parts + b * stride + i * s.ld + j, n);
        if (s.ds_col == 1) {
          store_as<odt>(static_cast<char*>(s.out) + i * s.ds_row * esize, j, v, n);
        } else {
          for (int q = 0; q < n; ++q) {
            V one{};
            one[0] = v[q];
            store_as<odt>(static_cast<char*>(s.out) + (i * s.ds_row + (j + q) * s.ds_col) * esize, 0, one, 1);
          }
        }
      }
  });
}
