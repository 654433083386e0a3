// Rotary embeddings on grids: the kernels of one work item, for one instruction set
// (compiled per set by cpu/per_isa.h from rotary_cpu.cpp, whose types they use). An item is
// a run of positions n0..n1 of one batch row of x [Bx, N', M] (every batch row of q and k
// when the positions are shared by the batch); position n is token prefix + n of q and k.
// Per frequency group g (one when W is shared by the heads, one per head otherwise):
//
//   xs [nn, M], cos / sin [nn, ldk]  the run's positions and the cos / sin of x . W[g, k]
//                                    (position_sincos: Triton's cos_sin_tile, lane for lane)
//   forward:  every head of the group in q, then in k, position by position: channel pairs
//             (a, b) -> (a cos - b sin, b cos + a sin), rounded once; channels F..D-1 copied
//   backward: the gradient rotated back (ga cos + gb sin, gb cos - ga sin) into dq / dk,
//             and the phase gradient cos * sum_h (gb a - ga b) - sin * sum_h (gb b + ga a)
//             -> dx += dphase W[g], dW[g]^T += x^T dphase (the block's partial, in item order)
//   table:    cos and sin each on both channels of a pair of the [2, Bx, G, N, F] table;
//             backward dphase = (gs_a + gs_b) cos - (gc_a + gc_b) sin
//
// Pairs are channels (2k, 2k+1) ("interleaved") or (k, k + F2) ("half"). A batch row's first
// item also copies its prefix tokens (their gradient, backward).
// Every product is rounded where triton_kernels/rotary.py rounds it (no contraction, see
// cpu/per_isa.h): forward outputs, tables and dq / dk equal the Triton interpreter's bitwise.

#include "cpu/simd.h"
#include "cpu/phase.h"

// Row (b, h, n) of a [B, H, N, D] view of element size es.
PF_INLINE const void* row_of(const T4& t, int64_t b, int64_t h, int64_t n, int64_t es) {
  return static_cast<const char*>(t.p) + (b * t.sb + h * t.sh + n * t.sn) * es;
}
PF_INLINE void* row_of(T4& t, int64_t b, int64_t h, int64_t n, int64_t es) {
  return static_cast<char*>(t.p) + (b * t.sb + h * t.sh + n * t.sn) * es;
}

// n <= W channels c0.. of a row with channel stride sd, as float32 (tail lanes zero):
// LightGlue's q and k are slices of a fused qkv tensor (sd = 3), gathered lane by lane
// (the gather instructions were slower: benchmarks/NOTES.md, C++ rotary kernels).
template <DT dt>
PF_INLINE V load_channels(const void* row, int64_t sd, int64_t c0, int n) {
  if (sd == 1) return load_as<dt>(row, c0, n);
  if (dt == DT::F32) {
    V v{};
    for (int i = 0; i < n; ++i) v[i] = static_cast<const float*>(row)[(c0 + i) * sd];
    return v;
  }
  VH h{};  // 16-bit lanes gathered, converted as one vector
  for (int i = 0; i < n; ++i) h[i] = static_cast<const uint16_t*>(row)[(c0 + i) * sd];
  return widen<dt>(h);
}

// Lanes of the channel pairs of frequencies k0..k0+W-1 (F = 2 F2 channels in all), for
// interleaved pairs (nlo, nhi: the two vectors of channels) and halves (n per half).
PF_INLINE void pair_lanes(int64_t k0, int64_t F2, int& nlo, int& nhi) {
  const int64_t left = 2 * (F2 - k0);
  nlo = static_cast<int>(left < W ? left : W);
  nhi = static_cast<int>(left <= W ? 0 : (left - W < W ? left - W : W));
}
PF_INLINE int half_lanes(int64_t k0, int64_t F2) { return static_cast<int>(F2 - k0 < W ? F2 - k0 : W); }

// The pairs of frequencies k = k0..k0+W-1: (first, second) channel, zero beyond F2.
template <DT dt>
PF_INLINE void load_pairs(const void* row, int64_t sd, int64_t k0, int64_t F2, bool half, V& first, V& second) {
  if (half) {
    const int n = half_lanes(k0, F2);
    first = load_channels<dt>(row, sd, k0, n);
    second = load_channels<dt>(row, sd, F2 + k0, n);
    return;
  }
  int nlo, nhi;
  pair_lanes(k0, F2, nlo, nhi);
  const V lo = load_channels<dt>(row, sd, 2 * k0, nlo);
  const V hi = nhi ? load_channels<dt>(row, sd, 2 * k0 + W, nhi) : splat(0.0f);
  deinterleave(lo, hi, first, second);
}
// The inverse into a row with unit channel stride, rounded once to dt.
template <DT dt>
PF_INLINE void store_pairs(void* row, int64_t k0, int64_t F2, bool half, V first, V second) {
  if (half) {
    const int n = half_lanes(k0, F2);
    store_as<dt>(row, k0, first, n);
    store_as<dt>(row, F2 + k0, second, n);
    return;
  }
  int nlo, nhi;
  pair_lanes(k0, F2, nlo, nhi);
  V lo, hi;
  interleave(first, second, lo, hi);
  store_as<dt>(row, 2 * k0, lo, nlo);
  if (nhi) store_as<dt>(row, 2 * k0 + W, hi, nhi);
}

// dst[c] = src[c] for F <= c < D (the channels the rotation leaves alone; F = 0: a prefix
// token); dst unit stride.
template <DT dt>
PF_INLINE void copy_tail(const void* src, int64_t sd, void* dst, int64_t F, int64_t D) {
  for (int64_t j = F; j < D; j += W) {
    const int n = static_cast<int>(D - j < W ? D - j : W);
    store_as<dt>(dst, j, load_channels<dt>(src, sd, j, n), n);
  }
}

// fn(h, n) for heads h0 <= h < h1 and positions n0 <= n < n1, in the order of t's memory:
// heads inside positions when a position's heads are nearer each other than a head's
// positions ("bnhd", LightGlue's fused qkv), else positions inside heads ("bhnd"). Either
// way the rows stream through memory in long runs (the hardware prefetcher stops at page
// boundaries).
template <typename F>
PF_INLINE void for_rows(const T4& t, int64_t h0, int64_t h1, int64_t n0, int64_t n1, const F& fn) {
  if (t.sh < t.sn) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t h = h0; h < h1; ++h) fn(h, n);
  } else {
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t n = n0; n < n1; ++n) fn(h, n);
  }
}

// The positions of an item into the thread's scratch.
PF_INLINE void load_positions(const RotCall& c, int64_t bx, int64_t n0, int64_t n1, const RotScratch& s) {
  for (int64_t n = n0; n < n1; ++n) {
    float* x = s.xs + (n - n0) * c.M;
    for (int64_t m = 0; m < c.M; ++m) x[m] = load_scalar(c.x, bx * c.sxb + n * c.sxn + m * c.sxm, c.xdt);
  }
}
// Their cos / sin under the frequencies of group g (padding lanes: phase 0).
PF_INLINE void run_phases(const RotCall& c, int64_t g, int64_t nn, const RotScratch& s) {
  const float* thi = c.thi + g * c.M * c.ldk;
  const float* tlo = c.tlo + g * c.M * c.ldk;
  for (int64_t i = 0; i < nn; ++i)
    for (int64_t k0 = 0; k0 < c.ldk; k0 += W) {
      V cs, sn;
      position_sincos(s.xs + i * c.M, c.M, thi, tlo, c.ldk, k0, cs, sn);
      vstore(s.cs + i * c.ldk + k0, cs);
      vstore(s.sn + i * c.ldk + k0, sn);
    }
}

// Item -> batch row of x, positions [n0, n1), batch rows [b0, b1) of q and k (positions
// shared by the batch: chunk item % bsplit of q's rows).
struct ItemRange {
  int64_t bx, n0, n1, b0, b1;
};
PF_INLINE ItemRange item_range(const RotCall& c, int64_t item) {
  ItemRange r;
  const int64_t run = item / c.bsplit, chunk = item % c.bsplit;
  r.bx = run / c.runs;
  r.n0 = (run % c.runs) * kRun;
  r.n1 = r.n0 + kRun < c.N ? r.n0 + kRun : c.N;
  const int64_t rows = (c.B + c.bsplit - 1) / c.bsplit;
  r.b0 = c.Bx == 1 ? (chunk * rows < c.B ? chunk * rows : c.B) : r.bx;
  r.b1 = c.Bx == 1 ? (r.b0 + rows < c.B ? r.b0 + rows : c.B) : r.bx + 1;
  return r;
}

// The prefix tokens of batch rows [b0, b1) of src (q, k or their gradients) copied whole
// into dst, when the item is its batch row's first run.
template <DT dt>
PF_INLINE void copy_prefix(const RotCall& c, const ItemRange& r, const T4& src, T4 dst, int64_t H) {
  if (r.n0 != 0 || c.prefix == 0) return;
  constexpr int64_t es = dt == DT::F32 ? 4 : 2;
  for (int64_t b = r.b0; b < r.b1; ++b)
    for_rows(src, 0, H, 0, c.prefix,
             [&](int64_t h, int64_t n) { copy_tail<dt>(row_of(src, b, h, n, es), src.sd, row_of(dst, b, h, n, es), 0, c.D); });
}

// Group g's share of dx and the block's dW[g]^T partial [M, ldk] from dphase [nn, ldk] (zero
// beyond F2): dx[m] summed over frequencies in 16 virtual lanes into s.dxs (set by group 0,
// added to by the others), the partial in position order.
PF_INLINE void phase_grads(const RotCall& c, const ItemRange& r, int64_t g, const RotScratch& s, float* part,
                           bool first) {
  const int64_t ldk = c.ldk;
  const float* wrt = c.wrt + g * c.M * ldk;
  for (int64_t i = 0; i < r.n1 - r.n0; ++i) {
    const float* gp = s.dphi + i * ldk;
    const float* x = s.xs + i * c.M;
    if (c.need_x) {
      for (int64_t m = 0; m < c.M; ++m) {
        Red acc;
        for (int v = 0; v < kRedVecs; ++v) acc.v[v] = splat(0.0f);
        for (int64_t k0 = 0; k0 < ldk; k0 += W) {
          V& a = acc.v[(k0 / W) % kRedVecs];
          a = a + vload(gp + k0) * vload(wrt + m * ldk + k0);
        }
        float& dx = s.dxs[i * c.M + m];
        dx = g == 0 ? red_total(acc) : dx + red_total(acc);
      }
    }
    if (c.need_w) {
      const bool start = first && i == 0;
      float* pg = part + g * c.M * ldk;
      for (int64_t m = 0; m < c.M; ++m) {
        float* p = pg + m * ldk;
        const V xm = splat(x[m]);
        if (start)
          for (int64_t k0 = 0; k0 < ldk; k0 += W) vstore(p + k0, xm * vload(gp + k0));
        else
          for (int64_t k0 = 0; k0 < ldk; k0 += W) vstore(p + k0, vload(p + k0) + xm * vload(gp + k0));
      }
    }
  }
}

// s.dxs, the item's dx rows, rounded into dx [Bx, N', M].
PF_INLINE void store_dx(const RotCall& c, const ItemRange& r, const RotScratch& s) {
  with_dt(c.dxdt, [&](auto tag) {
    constexpr DT dxdt = decltype(tag)::value;
    constexpr int64_t es = dxdt == DT::F32 ? 4 : 2;
    for (int64_t i = 0; i < r.n1 - r.n0; ++i) {
      void* dx = static_cast<char*>(c.dx) + (r.bx * c.N + r.n0 + i) * c.M * es;
      for (int64_t m = 0; m < c.M; ++m) {
        V one{};
        one[0] = s.dxs[i * c.M + m];
        store_as<dxdt>(dx, m, one, 1);
      }
    }
  });
}

void apply_forward_item(const RotCall& c, int64_t item, const RotScratch& s, float*, bool) {
  const ItemRange r = item_range(c, item);
  load_positions(c, r.bx, r.n0, r.n1, s);
  const int64_t F = 2 * c.F2;
  with_dt(c.dt, [&](auto tag) {
    constexpr DT dt = decltype(tag)::value;
    constexpr int64_t es = dt == DT::F32 ? 4 : 2;
    copy_prefix<dt>(c, r, c.q, c.oq, c.G * c.hq);
    copy_prefix<dt>(c, r, c.k, c.ok, c.G * c.hk);
    for (int64_t g = 0; g < c.G; ++g) {
      run_phases(c, g, r.n1 - r.n0, s);
      for (int64_t b = r.b0; b < r.b1; ++b)
        for (int which = 0; which < 2; ++which) {
          const T4& in = which ? c.k : c.q;
          T4 out = which ? c.ok : c.oq;
          const int64_t hg = which ? c.hk : c.hq;
          for_rows(in, g * hg, (g + 1) * hg, r.n0, r.n1, [&](int64_t h, int64_t n) {
            const void* src = row_of(in, b, h, c.prefix + n, es);
            void* dst = row_of(out, b, h, c.prefix + n, es);
            const float* cs = s.cs + (n - r.n0) * c.ldk;
            const float* sn = s.sn + (n - r.n0) * c.ldk;
            for (int64_t k0 = 0; k0 < c.F2; k0 += W) {
              V a, bb;
              load_pairs<dt>(src, in.sd, k0, c.F2, c.half, a, bb);
              const V cv = vload(cs + k0), sv = vload(sn + k0);
              store_pairs<dt>(dst, k0, c.F2, c.half, a * cv - bb * sv, bb * cv + a * sv);
            }
            copy_tail<dt>(src, in.sd, dst, F, c.D);
          });
        }
    }
  });
}

void apply_backward_item(const RotCall& c, int64_t item, const RotScratch& s, float* part, bool first) {
  const ItemRange r = item_range(c, item);
  const int64_t nn = r.n1 - r.n0, ldk = c.ldk, F = 2 * c.F2;
  const bool need_phase = c.need_x || c.need_w;
  load_positions(c, r.bx, r.n0, r.n1, s);
  with_dt(c.dt, [&](auto tag) {
    constexpr DT dt = decltype(tag)::value;
    if (c.need_q) copy_prefix<dt>(c, r, c.gq, c.dq, c.G * c.hq);
    if (c.need_k) copy_prefix<dt>(c, r, c.gk, c.dk, c.G * c.hk);
  });
  for (int64_t g = 0; g < c.G; ++g) {
    run_phases(c, g, nn, s);
    if (need_phase)
      for (int64_t i = 0; i < nn * ldk; i += W) {
        vstore(s.cross + i, splat(0.0f));
        vstore(s.dot + i, splat(0.0f));
      }
    with_dt(c.dt, [&](auto tag) {
      constexpr DT dt = decltype(tag)::value;
      constexpr int64_t es = dt == DT::F32 ? 4 : 2;
      for (int64_t b = r.b0; b < r.b1; ++b)
        for (int which = 0; which < 2; ++which) {
          const bool need_t = which ? c.need_k : c.need_q;
          if (!need_t && !need_phase) continue;
          const T4& t = which ? c.k : c.q;
          const T4& gr = which ? c.gk : c.gq;
          T4 d = which ? c.dk : c.dq;
          const int64_t hg = which ? c.hk : c.hq;
          for_rows(gr, g * hg, (g + 1) * hg, r.n0, r.n1, [&](int64_t h, int64_t n) {
            const int64_t i = (n - r.n0) * ldk;
            const void* grow = row_of(gr, b, h, c.prefix + n, es);
            const void* trow = row_of(t, b, h, c.prefix + n, es);
            void* drow = need_t ? row_of(d, b, h, c.prefix + n, es) : nullptr;
            for (int64_t k0 = 0; k0 < c.F2; k0 += W) {
              V ga, gb;
              load_pairs<dt>(grow, gr.sd, k0, c.F2, c.half, ga, gb);
              const V cv = vload(s.cs + i + k0), sv = vload(s.sn + i + k0);
              if (need_t) store_pairs<dt>(drow, k0, c.F2, c.half, ga * cv + gb * sv, gb * cv - ga * sv);
              if (need_phase) {
                V a, bb;
                load_pairs<dt>(trow, t.sd, k0, c.F2, c.half, a, bb);
                vstore(s.cross + i + k0, vload(s.cross + i + k0) + (gb * a - ga * bb));
                vstore(s.dot + i + k0, vload(s.dot + i + k0) + (gb * bb + ga * a));
              }
            }
            if (need_t) copy_tail<dt>(grow, gr.sd, drow, F, c.D);
          });
        }
    });
    if (!need_phase) continue;
    for (int64_t i = 0; i < nn * ldk; i += W)
      vstore(s.dphi + i, vload(s.cs + i) * vload(s.cross + i) - vload(s.sn + i) * vload(s.dot + i));
    phase_grads(c, r, g, s, part, first);
  }
  if (c.need_x) store_dx(c, r, s);
}

// fn(tag, cos row, sin row, i) for the positions of a table item under group g, after their
// cos / sin (scratch offset i); tag: the table's storage dtype as a type (with_dt).
template <typename F>
PF_INLINE void table_rows(const RotCall& c, const ItemRange& r, int64_t g, const RotScratch& s, const F& fn) {
  run_phases(c, g, r.n1 - r.n0, s);
  with_dt(c.dt, [&](auto tag) {
    constexpr int64_t es = decltype(tag)::value == DT::F32 ? 4 : 2;
    for (int64_t n = r.n0; n < r.n1; ++n) {
      char* crow = static_cast<char*>(c.tab.p) + (r.bx * c.tab.sb + g * c.tab.sh + n * c.tab.sn) * es;
      fn(tag, crow, crow + c.tab_plane * es, (n - r.n0) * c.ldk);
    }
  });
}

void table_forward_item(const RotCall& c, int64_t item, const RotScratch& s, float*, bool) {
  const ItemRange r = item_range(c, item);
  load_positions(c, r.bx, r.n0, r.n1, s);
  for (int64_t g = 0; g < c.G; ++g)
    table_rows(c, r, g, s, [&](auto tag, char* crow, char* srow, int64_t i) {
      constexpr DT dt = decltype(tag)::value;
      for (int64_t k0 = 0; k0 < c.F2; k0 += W) {
        const V cv = vload(s.cs + i + k0), sv = vload(s.sn + i + k0);
        store_pairs<dt>(crow, k0, c.F2, c.half, cv, cv);
        store_pairs<dt>(srow, k0, c.F2, c.half, sv, sv);
      }
    });
}

void table_backward_item(const RotCall& c, int64_t item, const RotScratch& s, float* part, bool first) {
  const ItemRange r = item_range(c, item);
  load_positions(c, r.bx, r.n0, r.n1, s);
  for (int64_t g = 0; g < c.G; ++g) {
    table_rows(c, r, g, s, [&](auto tag, const char* crow, const char* srow, int64_t i) {
      constexpr DT dt = decltype(tag)::value;
      for (int64_t k0 = 0; k0 < c.ldk; k0 += W) {
        V gca, gcb, gsa, gsb;  // zero beyond F2: dphase is zero there
        const int64_t f2 = k0 < c.F2 ? c.F2 : k0;
        load_pairs<dt>(crow, c.tab.sd, k0, f2, c.half, gca, gcb);
        load_pairs<dt>(srow, c.tab.sd, k0, f2, c.half, gsa, gsb);
        vstore(s.dphi + i + k0, (gsa + gsb) * vload(s.cs + i + k0) - (gca + gcb) * vload(s.sn + i + k0));
      }
    });
    phase_grads(c, r, g, s, part, first);
  }
  if (c.need_x) store_dx(c, r, s);
}

const RotKernels kRotKernels{apply_forward_item, apply_backward_item, table_forward_item, table_backward_item,
                             prepare_turns, sum_partials};
