// Learnable Fourier features + MLP: the kernels of one tile of rows, for one instruction
// set (compiled per set by cpu/per_isa.h from lff_cpu.cpp, whose types they use).
//
// A tile is nr <= kTileRows rows (row = one group of one position: M coordinates). Its
// features, hidden layer and activation live in the calling thread's scratch (L1/L2);
// only x, the output, dY and dx are touched in memory. Shapes (lff_cpu.cpp, LffDims):
//   xs [nr, M]   feats [nr, ldf]: cos | sin (scaled by 1/sqrt(F)) | 1 (backward)
//   a, h [nr, ldh]: pre-activation, activation | 1 (backward)    dy [nr, ldd] float32
//   ga [nr, ldh]   gr [nr, ldf]: dLoss/dfeats   gph [nr, ldk]: dLoss/dphase   dxs [nr, ldm]

#include "cpu/simd.h"
#include "cpu/phase.h"
#include "lff/lff_gemm.h"

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluTanhC = 0.044715f;

PF_INLINE V act_fwd(Act act, V z) {
  switch (act) {
    case Act::GELU:  // z * Phi(z): the erf form, without cancellation in the left tail
      return z * Math::normal_cdf(z);
    case Act::GELU_TANH: {
      const V u = (z + z * z * z * kGeluTanhC) * kSqrt2OverPi;
      return 0.5f * z * (1.0f + Math::tanh(u));
    }
    default:  // relu; NaN stays NaN
      return z < 0.0f ? splat(0.0f) : z;
  }
}

// g * act'(z)
PF_INLINE V act_bwd(Act act, V z, V g) {
  switch (act) {
    case Act::GELU:
      return g * (Math::normal_cdf(z) + z * Math::normal_pdf(z));
    case Act::GELU_TANH: {
      const V t = Math::tanh((z + z * z * z * kGeluTanhC) * kSqrt2OverPi);
      const V dinner = (1.0f + z * z * (3.0f * kGeluTanhC)) * kSqrt2OverPi;
      return g * (0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * dinner);
    }
    default:
      return z > 0.0f ? g : splat(0.0f);
  }
}

// feats[r, k] = cos(x_r . wr_k) / sqrt(F), feats[r, F2 + k] = sin(...) / sqrt(F), k < F2:
// the phase as in triton_kernels/lff_forward.py's cos_sin_tile (phase_term for the first
// coordinate, accumulate_phase for the others), vectorised over frequencies.
PF_INLINE void features(const LffCall& c, const float* xs, int64_t nr, float* feats) {
  const LffDims& d = c.d;
  for (int64_t r = 0; r < nr; ++r) {
    const float* x = xs + r * d.M;
    float* f = feats + r * d.ldf;
    for (int64_t k0 = 0; k0 < d.F2; k0 += W) {
      const int n = static_cast<int>(d.F2 - k0 < W ? d.F2 - k0 : W);
      V cs, sn;
      position_sincos(x, d.M, c.w.thi, c.w.tlo, d.ldk, k0, cs, sn);
      // the cosine's tail lanes must not overwrite the first sines: partial stores
      store_n(f + k0, cs * c.w.inv_sqrt_f, n);
      store_n(f + d.F2 + k0, sn * c.w.inv_sqrt_f, n);
    }
  }
}

// xs [nr, M] float32 from the positions' rows r0.. (any strides and floating dtype)
PF_INLINE void load_positions(const LffCall& c, int64_t r0, int64_t nr, float* xs) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t m = 0; m < c.d.M; ++m) xs[r * c.d.M + m] = load_scalar(c.io.x, (r0 + r) * c.io.sxr + m * c.io.sxm, c.io.xdt);
}

// a = b1 + feats @ w1, h = act(a): [nr, Hp] (padded columns: 0)
PF_INLINE void hidden(const LffCall& c, const LffScratch& s, int64_t nr) {
  const LffDims& d = c.d;
  const Gemm g{s.feats, d.ldf, 1, c.w.w1, d.Hp, c.w.b1, false, s.a, d.ldh, nr, d.Hp, d.F};
  gemm<DT::F32>(g);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t j = 0; j < d.Hp; j += W) vstore(s.h + r * d.ldh + j, act_fwd(d.act, vload(s.a + r * d.ldh + j)));
}

// Forward of rows [r0, r0 + nr): out rows = b2 + h @ w2 (or the features without the MLP),
// rounded once to the output dtype.
void forward_tile(const LffCall& c, int64_t r0, int64_t nr, const LffScratch& s) {
  const LffDims& d = c.d;
  load_positions(c, r0, nr, s.xs);
  features(c, s.xs, nr, s.feats);
  const int64_t esize = c.io.odt == DT::F32 ? 4 : 2;
  void* out = static_cast<char*>(c.io.out) + r0 * c.io.ldo * esize;
  if (!d.mlp) {
    with_dt(c.io.odt, [&](auto tag) {
      for (int64_t r = 0; r < nr; ++r)
        write_row<decltype(tag)::value>(static_cast<char*>(out) + r * c.io.ldo * esize, d.F, c.io.stream,
                                        [&](int64_t j, int) { return vload(s.feats + r * d.ldf + j); });
    });
    stream_fence();
    return;
  }
  hidden(c, s, nr);
  // y = b2 + h w2, a few rows at a time across all columns: each output row is written
  // from start to end (contiguous stores) while w2 (H x D) streams from L2.
  constexpr int64_t kRows = row_tile<4>() > 4 ? row_tile<4>() : 6;
  with_dt(c.io.odt, [&](auto tag) {
    for (int64_t i = 0; i < nr; i += kRows) {
      if (!c.io.stream) {  // ask for the next rows' lines now: their misses overlap this block
        const int64_t next = i + kRows < nr ? (nr - i - kRows < kRows ? nr - i - kRows : kRows) : 0;
        for (int64_t r = 0; r < next; ++r) {
          const char* row = static_cast<const char*>(out) + (i + kRows + r) * c.io.ldo * esize;
          for (int64_t b = 0; b < d.D * esize; b += 64) __builtin_prefetch(row + b, 1, 3);
        }
      }
      Gemm g{s.h + i * d.ldh, d.ldh, 1, c.w.w2, d.Dp, c.w.b2, false,
             static_cast<char*>(out) + i * c.io.ldo * esize, c.io.ldo, nr - i < kRows ? nr - i : kRows, d.D, d.H};
      g.stream = c.io.stream;
      gemm<decltype(tag)::value>(g);
    }
  });
  stream_fence();
}

// C (+)= A^T B over the tile's rows for C's rows [i0, i1): the weight gradients. A(i, k) =
// at[k * lda + i] (the tile's k-th row), B [nr, n] row-major; C [.., n] float32, ld ldc.
// The first tile of a block starts from zero, later ones from C (the block's partial sum).
PF_INLINE void grad_rows(const float* at, int64_t lda, const float* b, int64_t ldb, int64_t n, int64_t nr,
                         float* cbase, int64_t ldc, int64_t i0, int64_t i1, bool first) {
  if (i0 >= i1) return;
  const Gemm g{at + i0, 1, lda, b, ldb, nullptr, !first, cbase + i0 * ldc, ldc, i1 - i0, n, nr};
  gemm<DT::F32>(g);
}

// Backward of rows [r0, r0 + nr): dx rows, and the tile's contributions to the block's
// weight-gradient partials p (recomputing features, hidden layer and activation).
void backward_tile(const LffCall& c, int64_t r0, int64_t nr, const LffScratch& s, const LffPartials& p) {
  const LffDims& d = c.d;
  const LffNeeds& nd = c.needs;
  const bool need_phase = nd.x || nd.wr;
  const bool need_ga = d.mlp && (nd.b1 || nd.w1 || need_phase);
  const bool need_h = d.mlp && (nd.w2 || need_ga);
  const bool need_dy = need_h || (d.mlp && nd.b2) || need_phase;
  if (need_h || need_phase) {
    load_positions(c, r0, nr, s.xs);
    features(c, s.xs, nr, s.feats);
  }
  if (need_h) hidden(c, s, nr);
  // dY rows as float32: the gradient itself when it is float32 (row stride ldg), else a
  // converted copy in the scratch (zero-padded to Dp columns)
  const int64_t width = d.mlp ? d.D : d.F;
  const float* dy = s.dy;
  int64_t lddy = d.ldd, ndy = d.mlp ? d.Dp : d.F;
  if (need_dy && c.io.gdt == DT::F32) {
    dy = static_cast<const float*>(c.io.grad) + r0 * c.io.ldg;
    lddy = c.io.ldg;
    ndy = width;
  } else if (need_dy) {
    with_dt(c.io.gdt, [&](auto tag) {
      constexpr DT dt = decltype(tag)::value;
      for (int64_t r = 0; r < nr; ++r) {
        const void* grow = static_cast<const uint16_t*>(c.io.grad) + (r0 + r) * c.io.ldg;
        for (int64_t j = 0; j < width; j += W) {
          const int n = static_cast<int>(width - j < W ? width - j : W);
          store_n(s.dy + r * d.ldd + j, load_as<dt>(grow, j, n), n);
        }
      }
    });
  }
  const float* gr = dy;  // dLoss/dfeats: dY itself without the MLP
  int64_t ldgr = lddy;
  if (d.mlp) {
    if (need_ga) {
      // gh = dY @ w2^T, then ga = gh * act'(a)
      const Gemm g{dy, lddy, 1, c.w.w2t, d.Hp, nullptr, false, s.ga, d.ldh, nr, d.Hp, d.D};
      gemm<DT::F32>(g);
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < d.Hp; j += W) {
          float* q = s.ga + r * d.ldh + j;
          vstore(q, act_bwd(d.act, vload(s.a + r * d.ldh + j), vload(q)));
        }
    }
    // [dw2; db2] += [h | 1]^T dY (row H of the partial is db2)
    if (nd.w2 || nd.b2) {
      for (int64_t r = 0; r < nr; ++r) s.h[r * d.ldh + d.H] = 1.0f;
      grad_rows(s.h, d.ldh, dy, lddy, ndy, nr, p.dw2, d.Dp, nd.w2 ? 0 : d.H, nd.b2 ? d.H + 1 : d.H, p.first);
    }
    // [dw1; db1] += [feats | 1]^T ga (row F is db1)
    if (nd.w1 || nd.b1) {
      for (int64_t r = 0; r < nr; ++r) s.feats[r * d.ldf + d.F] = 1.0f;
      grad_rows(s.feats, d.ldf, s.ga, d.ldh, d.Hp, nr, p.dw1, d.Hp, nd.w1 ? 0 : d.F, nd.b1 ? d.F + 1 : d.F, p.first);
    }
    if (need_phase) {
      // dLoss/dfeats = ga @ w1^T
      const Gemm g{s.ga, d.ldh, 1, c.w.w1t, d.Fp, nullptr, false, s.gr, d.ldf, nr, d.Fp, d.H};
      gemm<DT::F32>(g);
      gr = s.gr;
      ldgr = d.ldf;
    }
  }
  if (!need_phase) return;
  // dLoss/dphase = g_sin * cos - g_cos * sin, with the features' 1/sqrt(F) (d cos = -sin,
  // d sin = cos); zero beyond F2
  for (int64_t r = 0; r < nr; ++r) {
    const float* g = gr + r * ldgr;
    const float* f = s.feats + r * d.ldf;
    for (int64_t k = 0; k < d.ldk; k += W) {
      const int n = static_cast<int>(d.F2 - k < 0 ? 0 : (d.F2 - k < W ? d.F2 - k : W));
      const V v = load_n(g + d.F2 + k, n) * load_n(f + k, n) - load_n(g + k, n) * load_n(f + d.F2 + k, n);
      vstore(s.gph + r * d.ldk + k, v);
    }
  }
  if (nd.x) {
    // dx = gph @ wr ([nr, F2] x [F2, ldm]), rounded to x's dtype
    const Gemm g{s.gph, d.ldk, 1, c.w.wr, d.ldm, nullptr, false, s.dxs, d.ldm, nr, d.ldm, d.F2};
    gemm<DT::F32>(g);
    with_dt(c.io.dxdt, [&](auto tag) {
      constexpr DT dt = decltype(tag)::value;
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t esize = dt == DT::F32 ? 4 : 2;
        void* row = static_cast<char*>(c.io.dx) + (r0 + r) * d.M * esize;
        for (int64_t m = 0; m < d.M; m += W)
          store_as<dt>(row, m, vload(s.dxs + r * d.ldm + m), static_cast<int>(d.M - m < W ? d.M - m : W));
      }
    });
  }
  // dwr^T [M, ldk] += xs^T gph
  if (nd.wr) grad_rows(s.xs, d.M, s.gph, d.ldk, d.ldk, nr, p.dwrt, d.ldk, 0, d.M, p.first);
}

const LffKernels kLffKernels{prepare_turns, forward_tile, backward_tile, sum_partials};
