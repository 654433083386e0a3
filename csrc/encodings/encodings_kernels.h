// Sinusoidal and DFT encodings, the fused add and the gradient to the positions: the
// kernels of a run of positions, for one instruction set (compiled per set by
// cpu/per_isa.h from encodings_cpu.cpp, whose types they use).
//
// Both encodings are sinusoids of the position at K frequencies (encodings_cpu.cpp):
//   sinusoidal: frequency i -> sin at column 2i, cos at 2i + 1 (interleaved)
//   dft:        frequency k = 1..K -> a cos at column k, a sin at K + k; column 0 is the
//               constant a0, column dim-1 cos(pi p) / sqrt(dim)
// computed as triton_kernels/encodings.py does, lane for lane: the phase p * nu from the
// float32 pair (nu_hi, nu_lo) (integer positions split into hi + lo), sincos_turns, times
// the amplitude, + the block term, + x, rounded once.

#include "cpu/simd.h"
#include "cpu/phase.h"

// The position of index l as hi + lo (float32, exact for integers below 2^53).
PF_INLINE void position(const EncCall& c, int64_t l, float& hi, float& lo) {
  const int64_t i = l * c.io.sp;
  const void* p = c.io.p;
  int64_t v;
  switch (c.io.pt) {
    case PT::F32:
      hi = static_cast<const float*>(p)[i];
      lo = 0.0f;
      return;
    case PT::BF16:
      hi = static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
      lo = 0.0f;
      return;
    case PT::F16:
      hi = static_cast<float>(static_cast<const c10::Half*>(p)[i]);
      lo = 0.0f;
      return;
    case PT::I8:
      v = static_cast<const int8_t*>(p)[i];
      break;
    case PT::U8:
      v = static_cast<const uint8_t*>(p)[i];
      break;
    case PT::I16:
      v = static_cast<const int16_t*>(p)[i];
      break;
    case PT::I32:
      v = static_cast<const int32_t*>(p)[i];
      break;
    default:
      v = static_cast<const int64_t*>(p)[i];
  }
  hi = static_cast<float>(v);
  lo = static_cast<float>(static_cast<double>(v) - static_cast<double>(hi));
}

// cos and sin of the position hi + lo at the frequencies t (turns per unit position).
PF_INLINE void sincos_at(const EncCall& c, float hi, float lo, const Phase& t, V& cs, V& sn) {
  Phase ph = phase_term(splat(hi), t);
  if (c.io.pos_int) ph = accumulate_phase(ph, splat(lo), t);
  sincos_turns(ph, cs, sn);
}
// ... at the frequencies j .. j + W - 1 of the spectrum
PF_INLINE void sincos_at(const EncCall& c, float hi, float lo, int64_t j, V& cs, V& sn) {
  sincos_at(c, hi, lo, Phase{vload(c.t.nu_hi + j), vload(c.t.nu_lo + j)}, cs, sn);
}
// ... at half a turn (dft: the last column, cos(pi p) / sqrt(dim))
PF_INLINE void sincos_half_turn(const EncCall& c, float hi, float lo, V& cs, V& sn) {
  sincos_at(c, hi, lo, Phase{splat(0.5f), splat(0.0f)}, cs, sn);
}

// row[0, dim) = encoding of the position (float32), + the block term.
PF_INLINE void encode_row(const EncCall& c, float hi, float lo, float* row) {
  const EncTables& t = c.t;
  const int64_t K = c.K;
  V cs, sn;
  if (!c.dft) {
    for (int64_t j = 0; j < K; j += W) {
      sincos_at(c, hi, lo, j, cs, sn);
      V lo_v, hi_v;  // (sin, cos) pairs; the amplitudes are 1
      interleave(sn, cs, lo_v, hi_v);
      vstore(row + 2 * j, lo_v);  // rows are padded: whole vectors may be stored
      vstore(row + 2 * j + W, hi_v);
    }
  } else {
    for (int64_t j = 0; j < K; j += W) {
      const int n = static_cast<int>(K - j < W ? K - j : W);
      sincos_at(c, hi, lo, j, cs, sn);
      store_n(row + 1 + j, cs * t.amp, n);  // partial: sines follow the cosines
      store_n(row + 1 + K + j, sn * t.amp, n);
    }
    row[0] = t.a0;
    sincos_half_turn(c, hi, lo, cs, sn);  // cos(pi p) / sqrt(dim)
    row[c.dim - 1] = cs[0] * t.a0;
  }
  if (t.bias)
    for (int64_t j = 0; j < c.dim; j += W) vstore(row + j, vload(row + j) + vload(t.bias + j));
}

// Positions [l0, l1) (at most kRunPositions): each encoded once into the thread's buffer
// rows [l1 - l0, ldrow], then written to the rows b * L + l (b < B) of the output (+ x's
// rows) batch by batch: x and the output stream as two contiguous runs at a time.
void forward_positions(const EncCall& c, int64_t l0, int64_t l1, float* buf) {
  const int64_t dim = c.dim, ldrow = c.ldrow;
  for (int64_t l = l0; l < l1; ++l) {
    float hi, lo;
    position(c, l, hi, lo);
    encode_row(c, hi, lo, buf + (l - l0) * ldrow);
  }
  with_dt(c.io.odt, [&](auto otag) {
    constexpr DT odt = decltype(otag)::value;
    with_dt(c.io.x ? c.io.xdt : DT::F32, [&](auto xtag) {
      constexpr DT xdt = decltype(xtag)::value;
      const int64_t oes = odt == DT::F32 ? 4 : 2, xes = xdt == DT::F32 ? 4 : 2;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t l = l0; l < l1; ++l) {
          const float* row = buf + (l - l0) * ldrow;
          const int64_t r = b * c.L + l;
          void* orow = static_cast<char*>(c.io.out) + r * c.io.ldo * oes;
          const void* xrow = c.io.x ? static_cast<const char*>(c.io.x) + r * c.io.ldx * xes : nullptr;
          write_row<odt>(orow, dim, c.io.stream, [&](int64_t j, int n) {
            return xrow ? vload(row + j) + load_as<xdt>(xrow, j, n) : vload(row + j);
          });
        }
    });
  });
  stream_fence();
}

// dp[l] = sum over frequencies of (g_sin * cos - g_cos * sin) * dphase for l in [l0, l1)
// (dphase = 2 pi nu amp = d(amp sin)/d(phase) * d(phase)/dp); summed in 16 virtual lanes.
void backward_positions(const EncCall& c, int64_t l0, int64_t l1) {
  const EncTables& t = c.t;
  const int64_t K = c.K;
  with_dt(c.io.gdt, [&](auto gtag) {
    constexpr DT gdt = decltype(gtag)::value;
    const int64_t ges = gdt == DT::F32 ? 4 : 2;
    with_dt(c.io.dpdt, [&](auto ptag) {
      for (int64_t l = l0; l < l1; ++l) {
        float hi, lo;
        position(c, l, hi, lo);
        const void* g = static_cast<const char*>(c.io.grad) + l * c.io.ldg * ges;
        Red acc;
        for (int i = 0; i < kRedVecs; ++i) acc.v[i] = splat(0.0f);
        for (int64_t j = 0; j < K; j += W) {
          V cs, sn, g_sin, g_cos;
          sincos_at(c, hi, lo, j, cs, sn);
          if (!c.dft) {
            const int64_t left = 2 * (K - j);
            const V a = load_as<gdt>(g, 2 * j, static_cast<int>(left < W ? left : W));
            const V b = load_as<gdt>(g, 2 * j + W, static_cast<int>(left - W < 0 ? 0 : (left - W < W ? left - W : W)));
            deinterleave(a, b, g_sin, g_cos);
          } else {
            const int n = static_cast<int>(K - j < W ? K - j : W);
            g_cos = load_as<gdt>(g, 1 + j, n);
            g_sin = load_as<gdt>(g, 1 + K + j, n);
          }
          const V dphase = vload(t.dphase + j);
          const V term = g_sin * cs * dphase - g_cos * sn * dphase;
          V& a = acc.v[(j / W) % kRedVecs];
          a = a + term;
        }
        float dp = red_total(acc);
        if (c.dft) {  // the last column, cos(pi p) / sqrt(dim): d/dp = -pi sin(pi p) / sqrt(dim)
          V cs, sn;
          sincos_half_turn(c, hi, lo, cs, sn);
          V gl{};
          gl[0] = load_as<gdt>(g, c.dim - 1, 1)[0];
          dp = dp - (gl * sn * t.half_dcos)[0];
        }
        V out{};
        out[0] = dp;
        store_as<decltype(ptag)::value>(c.io.dp, l, out, 1);
      }
    });
  });
}

const EncKernels kEncKernels{forward_positions, backward_positions};
