// Learnable Fourier rotary embeddings (LightGlue's layout): the kernels of one work item, for
// one instruction set (compiled per set by cpu/per_isa.h from rotary_cpu.cpp, whose types they
// use). An item is a run of positions n0..n1 of one batch row of x [Bx, N, M] (every batch
// row of q and k when the positions are shared by the batch):
//
//   xs [nn, M], cos / sin [nn, ldk]  the run's positions and the cos / sin of x . wr_k
//                                    (position_sincos: Triton's cos_sin_tile, lane for lane)
//   forward:  every head of q, then of k, position by position: channel pairs (e, o) ->
//             (e cos - o sin, o cos + e sin), rounded once; channels F..D-1 copied
//   backward: the gradient rotated back (ge cos + go sin, go cos - ge sin) into dq / dk,
//             and the phase gradient cos * sum_h (go e - ge o) - sin * sum_h (go o + ge e)
//             -> dx = dphase wr, dwr^T += x^T dphase (the block's partial, in item order)
//   table:    cos and sin each on channels 2k and 2k+1 of the [2, N, F] table; backward
//             dphase = (gs_2k + gs_2k+1) cos - (gc_2k + gc_2k+1) sin
//
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
// (the AVX-512 / AVX2 gather instructions measured 2-3x slower here, Zen 4).
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

// Lanes of the channel pairs of frequencies k0..k0+W-1 (F = 2 F2 channels in all).
PF_INLINE void pair_lanes(int64_t k0, int64_t F2, int& nlo, int& nhi) {
  const int64_t left = 2 * (F2 - k0);
  nlo = static_cast<int>(left < W ? left : W);
  nhi = static_cast<int>(left <= W ? 0 : (left - W < W ? left - W : W));
}

// Channels (2k, 2k+1) for k = k0..k0+W-1: (even, odd), zero beyond F2.
template <DT dt>
PF_INLINE void load_pairs(const void* row, int64_t sd, int64_t k0, int64_t F2, V& even, V& odd) {
  int nlo, nhi;
  pair_lanes(k0, F2, nlo, nhi);
  const V lo = load_channels<dt>(row, sd, 2 * k0, nlo);
  const V hi = nhi ? load_channels<dt>(row, sd, 2 * k0 + W, nhi) : splat(0.0f);
  deinterleave(lo, hi, even, odd);
}
// The inverse into a row with unit channel stride, rounded once to dt.
template <DT dt>
PF_INLINE void store_pairs(void* row, int64_t k0, int64_t F2, V even, V odd) {
  int nlo, nhi;
  pair_lanes(k0, F2, nlo, nhi);
  V lo, hi;
  interleave(even, odd, lo, hi);
  store_as<dt>(row, 2 * k0, lo, nlo);
  if (nhi) store_as<dt>(row, 2 * k0 + W, hi, nhi);
}

// dst[c] = src[c] for F <= c < D (the channels the rotation leaves alone); dst unit stride.
template <DT dt>
PF_INLINE void copy_tail(const void* src, int64_t sd, void* dst, int64_t F, int64_t D) {
  for (int64_t j = F; j < D; j += W) {
    const int n = static_cast<int>(D - j < W ? D - j : W);
    store_as<dt>(dst, j, load_channels<dt>(src, sd, j, n), n);
  }
}

// fn(h, n) for every head h < H and position n0 <= n < n1, in the order of t's memory:
// heads inside positions when a position's heads are nearer each other than a head's
// positions ("bnhd", LightGlue's fused qkv), else positions inside heads ("bhnd"). Either
// way the rows stream through memory in long runs (the hardware prefetcher stops at page
// boundaries: a run of 16 positions of one head, 4 KB, would start cold every time).
template <typename F>
PF_INLINE void for_rows(const T4& t, int64_t H, int64_t n0, int64_t n1, const F& fn) {
  if (t.sh < t.sn) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t h = 0; h < H; ++h) fn(h, n);
  } else {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = n0; n < n1; ++n) fn(h, n);
  }
}

// The positions of an item and their cos / sin into the thread's scratch.
PF_INLINE void run_phases(const RotCall& c, int64_t bx, int64_t n0, int64_t n1, const RotScratch& s) {
  for (int64_t n = n0; n < n1; ++n) {
    float* x = s.xs + (n - n0) * c.M;
    for (int64_t m = 0; m < c.M; ++m) x[m] = load_scalar(c.x, bx * c.sxb + n * c.sxn + m * c.sxm, c.xdt);
    for (int64_t k0 = 0; k0 < c.ldk; k0 += W) {  // padding lanes: phase 0
      V cs, sn;
      position_sincos(x, c.M, c.thi, c.tlo, c.ldk, k0, cs, sn);
      vstore(s.cs + (n - n0) * c.ldk + k0, cs);
      vstore(s.sn + (n - n0) * c.ldk + k0, sn);
    }
  }
}

// Item -> batch row of x, positions [n0, n1), batch rows [b0, b1) of q and k.
struct ItemRange {
  int64_t bx, n0, n1, b0, b1;
};
PF_INLINE ItemRange item_range(const RotCall& c, int64_t item) {
  ItemRange r;
  r.bx = item / c.runs;
  r.n0 = (item % c.runs) * kRun;
  r.n1 = r.n0 + kRun < c.N ? r.n0 + kRun : c.N;
  r.b0 = c.Bx == 1 ? 0 : r.bx;
  r.b1 = c.Bx == 1 ? c.B : r.bx + 1;
  return r;
}

// dx rows and the block's dwr^T partial [M, ldk] from dphase [nn, ldk] (zero beyond F2):
// dx[m] summed over frequencies in 16 virtual lanes, the partial in position order.
PF_INLINE void phase_grads(const RotCall& c, const ItemRange& r, const RotScratch& s, float* part, bool first) {
  const int64_t ldk = c.ldk;
  with_dt(c.need_x ? c.dxdt : DT::F32, [&](auto tag) {
    constexpr DT dxdt = decltype(tag)::value;
    for (int64_t i = 0; i < r.n1 - r.n0; ++i) {
      const float* g = s.dphi + i * ldk;
      const float* x = s.xs + i * c.M;
      if (c.need_x) {
        const int64_t es = dxdt == DT::F32 ? 4 : 2;
        void* dx = static_cast<char*>(c.dx) + (r.bx * c.N + r.n0 + i) * c.M * es;
        for (int64_t m = 0; m < c.M; ++m) {
          Red acc;
          for (int v = 0; v < kRedVecs; ++v) acc.v[v] = splat(0.0f);
          for (int64_t k0 = 0; k0 < ldk; k0 += W) {
            V& a = acc.v[(k0 / W) % kRedVecs];
            a = a + vload(g + k0) * vload(c.wrt + m * ldk + k0);
          }
          V one{};
          one[0] = red_total(acc);
          store_as<dxdt>(dx, m, one, 1);
        }
      }
      if (c.need_wr) {
        const bool start = first && i == 0;
        for (int64_t m = 0; m < c.M; ++m) {
          float* p = part + m * ldk;
          const V xm = splat(x[m]);
          if (start)
            for (int64_t k0 = 0; k0 < ldk; k0 += W) vstore(p + k0, xm * vload(g + k0));
          else
            for (int64_t k0 = 0; k0 < ldk; k0 += W) vstore(p + k0, vload(p + k0) + xm * vload(g + k0));
        }
      }
    }
  });
}

void apply_forward_item(const RotCall& c, int64_t item, const RotScratch& s, float*, bool) {
  const ItemRange r = item_range(c, item);
  run_phases(c, r.bx, r.n0, r.n1, s);
  const int64_t F = 2 * c.F2;
  with_dt(c.dt, [&](auto tag) {
    constexpr DT dt = decltype(tag)::value;
    constexpr int64_t es = dt == DT::F32 ? 4 : 2;
    for (int64_t b = r.b0; b < r.b1; ++b)
      for (int which = 0; which < 2; ++which) {
        const T4& in = which ? c.k : c.q;
        T4 out = which ? c.ok : c.oq;
        for_rows(in, which ? c.Hk : c.Hq, r.n0, r.n1, [&](int64_t h, int64_t n) {
          const void* src = row_of(in, b, h, n, es);
          void* dst = row_of(out, b, h, n, es);
          const float* cs = s.cs + (n - r.n0) * c.ldk;
          const float* sn = s.sn + (n - r.n0) * c.ldk;
          for (int64_t k0 = 0; k0 < c.F2; k0 += W) {
            V e, o;
            load_pairs<dt>(src, in.sd, k0, c.F2, e, o);
            const V cv = vload(cs + k0), sv = vload(sn + k0);
            store_pairs<dt>(dst, k0, c.F2, e * cv - o * sv, o * cv + e * sv);
          }
          copy_tail<dt>(src, in.sd, dst, F, c.D);
        });
      }
  });
}

void apply_backward_item(const RotCall& c, int64_t item, const RotScratch& s, float* part, bool first) {
  const ItemRange r = item_range(c, item);
  const int64_t nn = r.n1 - r.n0, ldk = c.ldk, F = 2 * c.F2;
  const bool need_phase = c.need_x || c.need_wr;
  run_phases(c, r.bx, r.n0, r.n1, s);
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
        const T4& g = which ? c.gk : c.gq;
        T4 d = which ? c.dk : c.dq;
        for_rows(g, which ? c.Hk : c.Hq, r.n0, r.n1, [&](int64_t h, int64_t n) {
          const int64_t i = (n - r.n0) * ldk;
          const void* grow = row_of(g, b, h, n, es);
          const void* trow = row_of(t, b, h, n, es);
          void* drow = need_t ? row_of(d, b, h, n, es) : nullptr;
          for (int64_t k0 = 0; k0 < c.F2; k0 += W) {
            V ge, go;
            load_pairs<dt>(grow, g.sd, k0, c.F2, ge, go);
            const V cv = vload(s.cs + i + k0), sv = vload(s.sn + i + k0);
            if (need_t) store_pairs<dt>(drow, k0, c.F2, ge * cv + go * sv, go * cv - ge * sv);
            if (need_phase) {
              V e, o;
              load_pairs<dt>(trow, t.sd, k0, c.F2, e, o);
              vstore(s.cross + i + k0, vload(s.cross + i + k0) + (go * e - ge * o));
              vstore(s.dot + i + k0, vload(s.dot + i + k0) + (go * o + ge * e));
            }
          }
          if (need_t) copy_tail<dt>(grow, g.sd, drow, F, c.D);
        });
      }
  });
  if (!need_phase) return;
  for (int64_t i = 0; i < nn * ldk; i += W)
    vstore(s.dphi + i, vload(s.cs + i) * vload(s.cross + i) - vload(s.sn + i) * vload(s.dot + i));
  phase_grads(c, r, s, part, first);
}

// fn(tag, cos row, sin row, i) for the positions of a table item, after their cos / sin
// (scratch offset i); tag: the table's storage dtype as a type (with_dt).
template <typename F>
PF_INLINE ItemRange table_rows(const RotCall& c, int64_t item, const RotScratch& s, const F& fn) {
  const ItemRange r = item_range(c, item);
  run_phases(c, r.bx, r.n0, r.n1, s);
  with_dt(c.dt, [&](auto tag) {
    constexpr int64_t es = decltype(tag)::value == DT::F32 ? 4 : 2;
    for (int64_t n = r.n0; n < r.n1; ++n) {
      char* crow = static_cast<char*>(c.tab.p) + n * c.tab.sn * es;
      fn(tag, crow, crow + c.tab.sh * es, (n - r.n0) * c.ldk);
    }
  });
  return r;
}

void table_forward_item(const RotCall& c, int64_t item, const RotScratch& s, float*, bool) {
  table_rows(c, item, s, [&](auto tag, char* crow, char* srow, int64_t i) {
    constexpr DT dt = decltype(tag)::value;
    for (int64_t k0 = 0; k0 < c.F2; k0 += W) {
      const V cv = vload(s.cs + i + k0), sv = vload(s.sn + i + k0);
      store_pairs<dt>(crow, k0, c.F2, cv, cv);
      store_pairs<dt>(srow, k0, c.F2, sv, sv);
    }
  });
}

void table_backward_item(const RotCall& c, int64_t item, const RotScratch& s, float* part, bool first) {
  const ItemRange r = table_rows(c, item, s, [&](auto tag, const char* crow, const char* srow, int64_t i) {
    constexpr DT dt = decltype(tag)::value;
    for (int64_t k0 = 0; k0 < c.ldk; k0 += W) {
      V gce, gco, gse, gso;  // zero beyond F2: dphase is zero there
      load_pairs<dt>(crow, c.tab.sd, k0, k0 < c.F2 ? c.F2 : k0, gce, gco);
      load_pairs<dt>(srow, c.tab.sd, k0, k0 < c.F2 ? c.F2 : k0, gse, gso);
      vstore(s.dphi + i + k0, (gse + gso) * vload(s.cs + i + k0) - (gce + gco) * vload(s.sn + i + k0));
    }
  });
  phase_grads(c, r, s, part, first);
}

const RotKernels kRotKernels{apply_forward_item, apply_backward_item, table_forward_item, table_backward_item,
                             prepare_turns, sum_partials};
