// The phase math of triton_kernels/_phase.py, for one instruction set (compiled per set
// after cpu/simd.h; no include guard, no system headers), operation for operation:
// frequencies in turns as a float32 pair hi + lo, the phase as an unevaluated sum, the
// reduction to a quarter turn and the same polynomials; contraction off (cpu/per_isa.h),
// so every product is rounded where Triton rounds it. position_sincos: the cos / sin of one
// position's phases (LFF features, rotary), from prepare_turns' tables.

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

