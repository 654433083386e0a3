// FLOATER integrator on the CPU: forward and discrete-adjoint backward.
//
// Shapes (floater_common.h): p0 [S, d], w1 [d+1, H], b1 [H], w2 [H+1, d], b2 [d],
// times [L], out / grad [S, L, d]; all contiguous, one dtype (float32 or float64).
//
// Design
// - States advance in lockstep, a "chunk" of R states at a time (R padded to an even count
//   with copies of the chunk's first state, whose incoming gradient is zero, so the
//   padding contributes exact zeros). Each stage is two regions (layer 1 over columns of H,
//   layer 2 and the RK combination over columns of d), whose kernels, per instruction set,
//   are in floater_kernels.h.
// - Parallelism (cpu/parallel.h, with its contention fallback). Small dynamics (weights
//   within a core's L2): chunks of up to 8 states run in parallel, each chunk serially.
//   Large dynamics: one chunk holds every state and a team of threads (parallel regions of
//   a few intervals each, barriers between the stage regions) splits every region over its
//   output columns, so that each core reads only its share of the weights.
// - Weight panels (large dynamics): each member's columns of a weight matrix are copied
//   into contiguous panels of kPanelCols columns (strided column pieces of a row-major
//   matrix map onto only part of the L2's sets and thrash it), visited forwards and
//   backwards on alternate stages ("snake") so that the panels used last, still in L2,
//   are used first again. Measurements: benchmarks/NOTES.md (floater_cpu.cpp).
// - Determinism: every output element is the same sequence of operations whatever the
//   thread count (a product's element is the same sum whichever member and panel compute
//   it, weight-gradient rows have one owner, chunks depend on the shapes only, per-chunk
//   partials are added in chunk order; no atomics).
// - Backward: the discrete adjoint. Intervals are walked backwards; each interval's
//   sub-steps are recomputed from its stored starting state (out[:, j-1] or p0) by the
//   forward's code (bitwise its trajectory) or read from the tape, then differentiated in
//   reverse, stage by stage; the interval's weight gradients are one product per weight.
#include "floater_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "cpu/vec.h"
#include "floater_kernels.h"

namespace posenc_fast {
namespace floater {

namespace {

using namespace ::posenc_fast::cpu;

// Memory the backward may use to keep an interval's stage values (see backward_chunk).
std::atomic<int64_t> g_keep_budget{int64_t{64} << 20};

// --- Drivers -----------------------------------------------------------------------------

// How states are grouped into chunks: a function of the shapes only (determinism).
struct Split {
  int64_t chunk;    // states per chunk
  int64_t nchunks;
  bool team;        // one chunk, every region split over columns by a team of threads
};

template <typename T>
Split split_states(int64_t S, int64_t d, int64_t H) {
  const int64_t weight_bytes = ((d + 1) * H + (H + 1) * d) * static_cast<int64_t>(sizeof(T));
  // Weights that stay in a core's L2 (>= 1 MiB on current x86): every chunk can own a core.
  // Chunks of at most 8 states (a register tile), as even as possible: S = 12 -> 2 x 6.
  if (weight_bytes <= (384 << 10)) {
    const int64_t nchunks = (S + 7) / 8;
    int64_t chunk = (S + nchunks - 1) / nchunks;
    chunk += chunk % 2;  // tiles come in even sizes
    return Split{chunk, (S + chunk - 1) / chunk, false};
  }
  return Split{S, 1, true};
}

// A chunk of states; rows padded to an even count (with copies of its first state).
struct Chunk {
  int64_t r0 = 0, rows = 0, R = 0;  // first state, real states, padded rows
};

// The taped forward's stage values (floater_cpu.h): Y_i and Z_i of every sub-step and stage
// of the first `intervals` intervals, no padding rows (a padding row's values are its
// chunk's first state's), Y: [intervals][substeps][stages][S][d], then Z: [...][S][H]. The
// backward then skips its forward pass over those intervals, bitwise the same.
template <typename T>
struct Tape {
  T* data = nullptr;  // nullptr: no tape
  int64_t intervals = 0, n = 0, stages = 0, S = 0, d = 0, H = 0;
  int64_t slot(int64_t j, int64_t k, int64_t i) const { return (j * n + k) * stages + i; }
  T* y(int64_t j, int64_t k, int64_t i) const { return data + slot(j, k, i) * S * d; }
  T* z(int64_t j, int64_t k, int64_t i) const { return data + intervals * n * stages * S * d + slot(j, k, i) * S * H; }
  bool has(int64_t j) const { return data != nullptr && j < intervals; }
};

// The threads that integrate one chunk together, in a parallel region (cpu/parallel.h):
// every member runs the same loops on its own columns; barrier() separates a region from
// the next one that reads what the others wrote. The fixed assignment of columns to threads
// keeps each core's packed panels in its own L2 (a work queue promises no such mapping).
struct Team {
  int rank = 0, size = 1;
  void barrier() const {
    if (size > 1) region_barrier();
  }
};

// Runs body(team) on `size` threads (fewer if OpenMP gives fewer: the work is split by the
// team's actual size, and the results do not depend on it).
template <typename F>
void run_team(int size, const F& body) {
  parallel_region(size, [&](int rank, int n) { body(Team{rank, n}); });
}

// Team members in a region: at least ~64k multiply-adds each per region (a member with less
// would wait at the barriers longer than it computes), at most the threads ATen may use;
// one inside another parallel region or while the machine looks contended (cpu/parallel.h).
inline int team_size(int64_t R, int64_t d, int64_t H, int64_t block) {
  if (at::in_parallel_region() || contended()) return 1;
  const int64_t nb = std::min((d + block - 1) / block, (H + block - 1) / block);
  const int64_t per_block = std::max<int64_t>(1, R * std::min(d, H) * block);
  const int64_t blocks_each = std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
  const int64_t most = std::max<int64_t>(1, nb / blocks_each);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), most)));
}

// One member's share: columns [c0, c1) of a dimension of n columns, whole blocks, as even
// as possible.
struct Cols {
  int64_t c0, c1;
};
inline Cols member_cols(int64_t n, int64_t block, const Team& tm) {
  const int64_t nb = (n + block - 1) / block;
  const int64_t b0 = nb * tm.rank / tm.size, b1 = nb * (tm.rank + 1) / tm.size;
  return Cols{std::min(n, b0 * block), std::min(n, b1 * block)};
}

// Columns c of rows [0, rows) between two row-major blocks of row strides ld_dst, ld_src.
template <typename T>
void copy_rows(T* dst, int64_t ld_dst, const T* src, int64_t ld_src, int64_t rows, const Cols& c) {
  if (c.c1 <= c.c0) return;
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + r * ld_dst + c.c0, src + r * ld_src + c.c0, sizeof(T) * (c.c1 - c.c0));
}

// Panel width of packed weights: a multiple of every instruction set's column block, fine
// enough for the snake to keep most panels in L2.
constexpr int64_t kPanelCols = 64;

// A weight matrix [K, N] as the region kernels read it: the matrix itself (packed ==
// false: one panel per region) or its column panels stored one after another (packed:
// panel [a, b) at w + K a, row stride b - a, panels of kPanelCols columns cut from each
// member's first column).
template <typename T>
struct Weights {
  const T* w = nullptr;
  int64_t K = 0, N = 0;
  bool packed = false;
  Panel<T> panel(int64_t a, int64_t b) const {
    return packed ? Panel<T>{w + K * a, b - a, a, b} : Panel<T>{w + a, N, a, b};
  }
};

// Calls fn(a, b) for the panels of columns [c.c0, c.c1): one panel when not packed, else
// kPanelCols-wide panels, in column order or (reverse) backwards.
template <typename F>
PF_INLINE void for_panels(const Cols& c, bool packed, bool reverse, const F& fn) {
  if (c.c0 >= c.c1) return;
  if (!packed) {
    fn(c.c0, c.c1);
    return;
  }
  const int64_t n = (c.c1 - c.c0 + kPanelCols - 1) / kPanelCols;
  for (int64_t q = 0; q < n; ++q) {
    const int64_t i = reverse ? n - 1 - q : q;
    const int64_t a = c.c0 + i * kPanelCols;
    fn(a, std::min(c.c1, a + kPanelCols));
  }
}

// Packs columns c of a member's share: element (k, c) of the [K, N] matrix is
// src[k * sk + c * sn] (sn = 1: a row-major matrix; sk = 1: its transpose).
template <typename T>
void pack_panels(T* dst, const T* src, int64_t sk, int64_t sn, int64_t K, const Cols& c) {
  for_panels(c, true, false, [&](int64_t a, int64_t b) {
    T* p = dst + K * a;
    const int64_t w = b - a;
    if (sn == 1) {
      for (int64_t k = 0; k < K; ++k) std::memcpy(p + k * w, src + k * sk + a, sizeof(T) * w);
    } else {  // transposed source: read its rows (contiguous in k), write the panel's columns
      for (int64_t n = a; n < b; ++n)
        for (int64_t k = 0; k < K; ++k) p[k * w + (n - a)] = src[k * sk + n * sn];
    }
  });
}

// The four products' weights: forward z = y w1[:d], k = a w2[:H]; backward
// gz = gk w2[:H]^T, gy = gz w1[:d]^T.
template <typename T>
struct Layers {
  Weights<T> w1, w2, w2T, w1T;
};

// Storage of the packed (or transposed) copies.
template <typename T>
struct LayerCopies {
  std::vector<T> w1, w2, w2T, w1T;
};

// One member's share of a chunk's work: its columns of d and of H, and how many stages it
// has swept over its panels (panels go forwards on even sweeps, backwards on odd ones).
struct Share {
  Team tm;
  Cols cd, ch;
  int64_t sweeps = 0;
};

template <typename T>
class Integrator {
 public:
  Integrator(const Dyn<T>& dyn, const Layers<T>& lay, const Options& opt, const T* times, int64_t L,
             const Kernels<T>& kern)
      : dyn_(dyn), lay_(lay), tab_(tableau(opt.method)), times_(times), L_(L), n_(opt.substeps), kern_(kern) {}

  Share share(const Team& tm) const {
    return Share{tm, member_cols(dyn_.d, kern_.block, tm), member_cols(dyn_.H, kern_.block, tm)};
  }

  // Fill columns c of the padded [R, width] block (each padding row a copy of the chunk's
  // first state's) from rows r0..r0+rows of src (row stride ld): states, or a tape slot.
  static void load_rows(T* dst, int64_t width, const T* src, int64_t ld, const Chunk& ch, const Cols& c) {
    for (int64_t r = 0; r < ch.R; ++r) {
      const int64_t rr = r < ch.rows ? r : 0;
      copy_cols(dst + r * width, src + (ch.r0 + rr) * ld, c);
    }
  }
  static void copy_cols(T* dst, const T* src, const Cols& c) { copy_rows(dst, 0, src, 0, 1, c); }
  // dst[r, c] = src[r, c] for rows < R (row stride d), the member's columns
  void copy_block(T* dst, const T* src, int64_t R, const Cols& c) const {
    copy_rows(dst, dyn_.d, src, dyn_.d, R, c);
  }

  void stage_times(T t, T h, int i, T* init1, T* init2, const Share& sh) const {
    const T tau = t + static_cast<T>(tab_.c[i]) * h;
    const int64_t d = dyn_.d, H = dyn_.H;
    for (int64_t c = sh.ch.c0; c < sh.ch.c1; ++c) init1[c] = dyn_.b1[c] + tau * dyn_.w1[d * H + c];
    for (int64_t c = sh.cd.c0; c < sh.cd.c1; ++c) init2[c] = dyn_.b2[c] + tau * dyn_.w2[H * d + c];
  }

  // Packs the member's panels of the weights the caller needs (packed layers only).
  void pack(const Share& sh, LayerCopies<T>& cp, bool backward) const {
    const int64_t d = dyn_.d, H = dyn_.H;
    if (lay_.w1.packed) pack_panels(cp.w1.data(), dyn_.w1, H, 1, d, sh.ch);
    if (lay_.w2.packed) pack_panels(cp.w2.data(), dyn_.w2, d, 1, H, sh.cd);
    if (backward && lay_.w2T.packed) pack_panels(cp.w2T.data(), dyn_.w2, 1, d, d, sh.ch);
    if (backward && lay_.w1T.packed) pack_panels(cp.w1T.data(), dyn_.w1, 1, H, H, sh.cd);
  }

  // Where a step's stage values go (the backward keeps them).
  struct StageStore {
    T* y[kMaxStages];
    T* z[kMaxStages];
    T* a[kMaxStages];
    T* k[kMaxStages];
  };

  // One RK step of the R-row block P (in place) from t with step h; the stage values go to
  // st (Y_i, Z_i, A_i, K_i). Team: P must be complete on entry (a barrier after the last
  // write of any member), and P and the stage values are complete on exit.
  void step(Share& sh, T* P, int64_t R, T t, T h, const StageStore& st, T* init1, T* init2) const {
    Fwd<T> f{};
    f.dyn = dyn_;
    f.R = R;
    f.h = h;
    f.init1 = init1;
    f.init2 = init2;
    for (int i = 0; i < tab_.stages; ++i) {
      stage_times(t, h, i, init1, init2, sh);  // the member's own columns: no barrier
      f.y = i == 0 ? P : st.y[i];
      f.z = st.z[i];
      f.a = st.a[i];
      f.k = st.k[i];
      f.nk = 0;
      f.base = P;
      // the next stage's input Y_{i+1} = P + h sum_j a[i+1][j] K_j, or after the last stage
      // the new state P + h sum_j b[j] K_j
      const bool last = i + 1 == tab_.stages;
      const double* row = last ? tab_.b : tab_.a[i + 1];
      f.dst = last ? P : st.y[i + 1];
      for (int j = 0; j <= i; ++j) {
        if (row[j] != 0.0) {
          f.ks[f.nk] = st.k[j];
          f.coef[f.nk++] = static_cast<T>(row[j]);
        }
      }
      const bool rev = (sh.sweeps++ & 1) != 0;
      for_panels(sh.ch, lay_.w1.packed, rev, [&](int64_t a, int64_t b) { kern_.layer1(f, lay_.w1.panel(a, b)); });
      sh.tm.barrier();  // A complete; every member is done reading Y (dst may overwrite it)
      for_panels(sh.cd, lay_.w2.packed, rev, [&](int64_t a, int64_t b) { kern_.layer2(f, lay_.w2.panel(a, b)); });
      sh.tm.barrier();  // dst complete; every member is done reading A
    }
  }

  T interval_start(int64_t j) const { return j == 0 ? T(0) : times_[j - 1]; }

  // A team integrates in a sequence of parallel regions of ~kRegionMacs multiply-adds
  // (a few intervals) each and decides its size again before each one: the contention
  // fallback (cpu/parallel.h) judges a region when it ends, so one region around a whole
  // integration could run to its end with a member starved at every barrier. No number
  // changes: members own fixed columns for a given team size; panels are repacked only when
  // the size changes. Back-off: each team region judged contended in a row (over all calls:
  // contended_streak) doubles the regions then run on one thread, up to 2^kMaxStreak; an
  // uncontended team region resets the streak. Measurements: benchmarks/NOTES.md.
  static constexpr double kRegionMacs = 5.0e7;
  static constexpr int kMaxStreak = 6;
  static std::atomic<int>& contended_streak() {
    static std::atomic<int> streak{0};
    return streak;
  }
  struct Segments {
    int64_t intervals;  // per region
    int threads;        // 1: one thread throughout; else the most a team may have
    int64_t R, block;
    const Integrator* integ;
    int packed_for = 0, last = 0;
    int64_t solo_left = 0;  // regions to run on one thread before trying a team again
    bool tried = false;     // the last region ran on a team
    // work: multiply-adds per state and interval relative to the forward's (backward ~3)
    Segments(const Integrator& in, int64_t R, double work, int threads)
        : threads(threads), R(R), block(in.kern_.block), integ(&in) {
      const double per = work * 2.0 * static_cast<double>(R) * static_cast<double>(in.n_) * in.tab_.stages *
                         static_cast<double>(in.dyn_.d) * static_cast<double>(in.dyn_.H);
      intervals = std::max<int64_t>(1, static_cast<int64_t>(kRegionMacs / std::max(per, 1.0)));
    }
    int team() {  // the next region's size (the last region's panels are packed for `last`)
      packed_for = last;
      if (threads <= 1) return 1;
      if (tried) {  // was the last (team) region judged contended (cpu/parallel.h)?
        tried = false;
        if (contended()) {
          const int streak = std::min(contended_streak().fetch_add(1) + 1, kMaxStreak);
          solo_left = int64_t{1} << streak;
        } else {
          contended_streak().store(0);
        }
      }
      if (solo_left > 0) {
        --solo_left;
        return 1;
      }
      const int size = team_size(R, integ->dyn_.d, integ->dyn_.H, block);
      tried = size > 1;
      return size;
    }
    bool repack(const Team& tm) const { return tm.size != packed_for; }
    void ran(const Team& tm) {
      if (tm.rank == 0) last = tm.size;
    }
  };

  // ---- forward of one chunk (on `threads` threads: a team when more than one) ----
  void forward_chunk(const T* p0, T* out, const Chunk& ch, int threads, LayerCopies<T>* cp,
                     const Tape<T>& tape) const {
    const int64_t d = dyn_.d, H = dyn_.H, R = ch.R;
    std::vector<T> P(R * d), init1(H), init2(d);
    // Without a tape the forward keeps one Y buffer (stage i+1 overwrites stage i's input
    // after layer 1 has read it) and one Z/A buffer; with one, a Y and a Z buffer per
    // stage, copied to the tape after each step. The slopes K_i all live until the step ends.
    const int64_t nbuf = tape.data ? kMaxStages : 1;
    std::vector<T> Y(nbuf * R * d), Z(nbuf * R * H), A(R * H), K(kMaxStages * R * d);
    StageStore st{};
    for (int i = 0; i < kMaxStages; ++i) {
      st.y[i] = Y.data() + (tape.data ? i : 0) * R * d;
      st.z[i] = Z.data() + (tape.data ? i : 0) * R * H;
      st.a[i] = A.data();
      st.k[i] = K.data() + i * R * d;
    }
    // A member copies its own columns (those it wrote: no barrier needed) of the chunk's
    // real rows; stage 0's input is the state P itself.
    auto record = [&](const Share& sh, int64_t j, int64_t k, bool before) {
      if (before) {
        copy_rows(tape.y(j, k, 0) + ch.r0 * d, d, P.data(), d, ch.rows, sh.cd);
        return;
      }
      for (int i = 0; i < tab_.stages; ++i) {
        if (i > 0) copy_rows(tape.y(j, k, i) + ch.r0 * d, d, st.y[i], d, ch.rows, sh.cd);
        copy_rows(tape.z(j, k, i) + ch.r0 * H, H, st.z[i], H, ch.rows, sh.ch);
      }
    };
    Segments seg(*this, R, 1.0, threads);
    for (int64_t j0 = 0; j0 < L_; j0 += seg.intervals) {
      const int64_t j1 = std::min(L_, j0 + seg.intervals);
      run_team(seg.team(), [&](const Team& tm) {
        Share sh = share(tm);
        if (cp && seg.repack(tm)) pack(sh, *cp, false);
        if (j0 == 0) load_rows(P.data(), d, p0, d, ch, sh.cd);
        sh.tm.barrier();  // P and every member's panels are ready
        for (int64_t j = j0; j < j1; ++j) {
          const T tp = interval_start(j);
          const T h = (times_[j] - tp) / static_cast<T>(n_);
          for (int64_t k = 0; k < n_; ++k) {
            if (tape.has(j)) record(sh, j, k, true);
            step(sh, P.data(), R, tp + static_cast<T>(k) * h, h, st, init1.data(), init2.data());
            if (tape.has(j)) record(sh, j, k, false);
          }
          for (int64_t r = 0; r < ch.rows; ++r)
            copy_cols(out + ((ch.r0 + r) * L_ + j) * d, P.data() + r * d, sh.cd);
        }
        seg.ran(tm);
      });
    }
  }

  // ---- backward of one chunk (on `threads` threads: a team when more than one) ----
  // dW: accumulators of this chunk (dw1, db1, dw2, db2 may be nullptr), dtimes [L] (or null)
  void backward_chunk(const T* grad, const T* out, const T* p0, T* dp0, T* dw1, T* db1, T* dw2, T* db2,
                      T* dtimes, const Chunk& ch, int threads, LayerCopies<T>* cp, const Tape<T>& tape) const {
    const int64_t d = dyn_.d, H = dyn_.H, R = ch.R, S_ = tab_.stages;
    const int64_t Rd = R * d, RH = R * H;
    // Within the budget, the stage values (and adjoints) of every sub-step of an interval are
    // kept: one forward pass per interval, weight gradients in one pass per interval. Else
    // only the sub-steps' starting states: each step is recomputed before it is
    // differentiated, and the weight gradients are added step by step.
    const int64_t per_step = S_ * (3 * Rd + 3 * RH + 2 * R);
    const bool keep_all = n_ * per_step * static_cast<int64_t>(sizeof(T)) <= g_keep_budget.load();
    const int64_t nkeep = keep_all ? n_ : 1;
    const bool need_w = dw1 || db1 || dw2 || db2;
    std::vector<T> starts(keep_all ? 0 : n_ * Rd), lam(Rd, T(0)), P(Rd), init1(H), init2(d);
    std::vector<T> Y(nkeep * S_ * Rd), Z(nkeep * S_ * RH), A(nkeep * S_ * RH), K(nkeep * S_ * Rd);
    std::vector<T> GK(nkeep * S_ * Rd), GZ(nkeep * S_ * RH), GY(Rd), tau(nkeep * S_ * R);
    std::vector<T> scratch_y(keep_all ? 0 : Rd), scratch_z(keep_all ? 0 : RH), scratch_a(keep_all ? 0 : RH);
    std::vector<double> dt_row(R), dh_row(R);
    std::vector<StageStore> keep(nkeep);
    for (int64_t k = 0; k < nkeep; ++k) {
      for (int i = 0; i < S_; ++i) {
        keep[k].y[i] = Y.data() + (k * S_ + i) * Rd;
        keep[k].z[i] = Z.data() + (k * S_ + i) * RH;
        keep[k].a[i] = A.data() + (k * S_ + i) * RH;
        keep[k].k[i] = K.data() + (k * S_ + i) * Rd;
      }
    }
    StageStore fwd_only{};
    if (!keep_all) {
      for (int i = 0; i < S_; ++i) {
        fwd_only.y[i] = scratch_y.data();
        fwd_only.z[i] = scratch_z.data();
        fwd_only.a[i] = scratch_a.data();
        fwd_only.k[i] = K.data() + i * Rd;
      }
    }
    std::vector<T> xt1(need_w ? (d + 2) * nkeep * S_ * R : 0), xt2(need_w ? (H + 2) * nkeep * S_ * R : 0);
    // Weight gradients of the kept steps: the member transposes its columns of Y and A, then
    // adds its share of the weight-gradient rows (each row owned by one member).
    auto flush = [&](const Share& sh, int64_t steps) {
      if (!need_w) return;
      const int64_t Rf = steps * S_ * R;
      transpose_cols(xt1.data(), Y.data(), Rf, d, sh.cd);
      transpose_cols(xt2.data(), A.data(), Rf, H, sh.ch);
      if (sh.tm.rank == 0) {
        time_rows(xt1.data(), Rf, d, tau.data());
        time_rows(xt2.data(), Rf, H, tau.data());
      }
      sh.tm.barrier();
      const Flush<T> f{Rf, d, H, xt1.data(), xt2.data(), GZ.data(), GK.data(), dw1, db1, dw2, db2};
      const int64_t units = d + H + 4;
      kern_.flush(f, units * sh.tm.rank / sh.tm.size, units * (sh.tm.rank + 1) / sh.tm.size);
      sh.tm.barrier();  // Y, A, GZ, GK may be overwritten
    };
    Segments seg(*this, R, 3.0, threads);  // the backward: ~3x the forward's work
    for (int64_t j1 = L_; j1 > 0; j1 -= seg.intervals) {
      const int64_t j0 = std::max<int64_t>(0, j1 - seg.intervals);
      run_team(seg.team(), [&](const Team& tm) {
        Share sh = share(tm);
        const bool lead = tm.rank == 0;  // the serial bookkeeping (times' gradient)
        if (cp && seg.repack(tm)) pack(sh, *cp, true);
        const T nT = static_cast<T>(n_);
        for (int64_t j = j1 - 1; j >= j0; --j) {
          // lam += grad[:, j]
          for (int64_t r = 0; r < ch.rows; ++r) {
            const T* gr = grad + ((ch.r0 + r) * L_ + j) * d;
            T* lr = lam.data() + r * d;
            for (int64_t c = sh.cd.c0; c < sh.cd.c1; ++c) lr[c] += gr[c];
          }
          const T tp = interval_start(j);
          const T h = (times_[j] - tp) / nT;
          const bool taped = keep_all && tape.has(j);
          // the interval's starting state (the forward's own values: out[:, j-1] or p0),
          // unless the tape holds the interval's stage values
          if (!taped) load_rows(P.data(), d, j == 0 ? p0 : out + (j - 1) * d, j == 0 ? d : L_ * d, ch, sh.cd);
          if (taped) {
            // the forward's stage values from the tape (the chunk's padding rows: its first
            // state's), the activations recomputed from Z
            for (int64_t k = 0; k < n_; ++k) {
              for (int i = 0; i < S_; ++i) {
                load_rows(keep[k].y[i], d, tape.y(j, k, i), d, ch, sh.cd);
                load_rows(keep[k].z[i], H, tape.z(j, k, i), H, ch, sh.ch);
                for (int64_t r = 0; r < R && sh.ch.c1 > sh.ch.c0; ++r)
                  kern_.activate(dyn_.act, keep[k].z[i] + r * H + sh.ch.c0, keep[k].a[i] + r * H + sh.ch.c0,
                                 sh.ch.c1 - sh.ch.c0);
              }
            }
            sh.tm.barrier();  // the members' columns (and, at the first interval, the panels) ready
          } else if (keep_all) {
            // one forward pass over the interval, keeping every stage value (Y_0 = the state)
            sh.tm.barrier();  // P (and, at the first interval, the panels) ready
            for (int64_t k = 0; k < n_; ++k) {
              copy_block(keep[k].y[0], P.data(), R, sh.cd);
              step(sh, P.data(), R, tp + static_cast<T>(k) * h, h, keep[k], init1.data(), init2.data());
            }
          } else {
            copy_block(starts.data(), P.data(), R, sh.cd);
            for (int64_t k = 1; k < n_; ++k) {
              copy_block(starts.data() + k * Rd, starts.data() + (k - 1) * Rd, R, sh.cd);
              sh.tm.barrier();
              step(sh, starts.data() + k * Rd, R, tp + static_cast<T>(k - 1) * h, h, fwd_only, init1.data(),
                   init2.data());
            }
          }
          double dT = 0.0, dTprev = 0.0;
          for (int64_t k = n_ - 1; k >= 0; --k) {
            const T t = tp + static_cast<T>(k) * h;
            const int64_t slot = keep_all ? k : 0;
            const StageStore& st = keep[slot];
            if (!keep_all) {  // recompute step k, keeping its stage values
              copy_block(P.data(), starts.data() + k * Rd, R, sh.cd);
              copy_block(st.y[0], P.data(), R, sh.cd);
              sh.tm.barrier();
              step(sh, P.data(), R, t, h, st, init1.data(), init2.data());
            }
            if (lead) {
              for (int i = 0; i < S_; ++i) {
                const T ti = t + static_cast<T>(tab_.c[i]) * h;
                std::fill_n(tau.data() + (slot * S_ + i) * R, R, ti);
              }
            }
            backprop_step(sh, R, ch.rows, t, h, st, lam.data(), GK.data() + slot * S_ * Rd,
                          GZ.data() + slot * S_ * RH, GY.data(), dtimes ? dt_row.data() : nullptr, dh_row.data());
            if (!keep_all) flush(sh, 1);
            if (dtimes && lead) {
              double dt_sum = 0.0, dh_sum = 0.0;
              for (int64_t r = 0; r < ch.rows; ++r) {
                dt_sum += dt_row[r];
                dh_sum += dh_row[r];
              }
              const double kn = static_cast<double>(k) / static_cast<double>(n_);
              dT += dt_sum * kn + dh_sum / static_cast<double>(n_);
              dTprev += dt_sum * (1.0 - kn) - dh_sum / static_cast<double>(n_);
            }
          }
          if (keep_all) flush(sh, n_);
          if (dtimes && lead) {
            dtimes[j] += static_cast<T>(dT);
            if (j > 0) dtimes[j - 1] += static_cast<T>(dTprev);
          }
        }
        if (dp0 && j0 == 0) {
          for (int64_t r = 0; r < ch.rows; ++r) copy_cols(dp0 + (ch.r0 + r) * d, lam.data() + r * d, sh.cd);
        }
        seg.ran(tm);
        });
    }
  }

  // Differentiate one step given its stored stage values. lam: dLoss/d(state after the
  // step) on entry, dLoss/d(state before) on exit. GK, GZ: [stages][R, d] and
  // [stages][R, H], the adjoints of every stage's slope and pre-activation (kept for
  // the weight gradients). Team: every member updates its own columns; the time terms
  // (dot products over whole rows) are the lead's, after a barrier. Everything is complete
  // on exit.
  void backprop_step(Share& sh, int64_t R, int64_t rows, T t, T h, const StageStore& st, T* lam, T* GK, T* GZ,
                     T* GY, double* dt_row, double* dh_row) const {
    const int64_t d = dyn_.d, H = dyn_.H, Rd = R * d, RH = R * H;
    const int S_ = tab_.stages;
    const Team& tm = sh.tm;
    const bool lead = tm.rank == 0;
    // dLoss/dK_i = h b_i lam; dLoss/dh gets lam . sum_i b_i K_i
    for (int i = 0; i < S_; ++i) {
      const T hb = h * static_cast<T>(tab_.b[i]);
      T* g = GK + i * Rd;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = sh.cd.c0; c < sh.cd.c1; ++c) g[r * d + c] = hb * lam[r * d + c];
    }
    // (the time terms only when the times need a gradient: dt_row == nullptr otherwise)
    if (dt_row) {
      tm.barrier();  // lam complete
      for (int64_t r = 0; lead && r < rows; ++r) {
        double acc = 0.0;
        for (int i = 0; i < S_; ++i) {
          if (tab_.b[i] == 0.0) continue;
          acc += tab_.b[i] * dot(lam + r * d, st.k[i] + r * d, d);
        }
        dh_row[r] = acc;
        dt_row[r] = 0.0;
      }
    }
    const T* w1t = dyn_.w1 + d * H;
    const T* w2t = dyn_.w2 + H * d;
    // lam keeps accumulating dLoss/dP: the identity path P -> P_new plus every stage's gy.
    for (int i = S_ - 1; i >= 0; --i) {
      Bwd<T> g{};
      g.dyn = dyn_;
      g.R = R;
      g.tau = t + static_cast<T>(tab_.c[i]) * h;
      g.y = st.y[i];
      g.z = st.z[i];
      g.a = st.a[i];
      g.gk = GK + i * Rd;
      g.gz = GZ + i * RH;
      g.gy = GY;
      g.lam = lam;
      g.nk = 0;
      for (int j = 0; j < i; ++j) {
        if (tab_.a[i][j] != 0.0) {
          g.gks[g.nk] = GK + j * Rd;
          g.coef[g.nk++] = h * static_cast<T>(tab_.a[i][j]);
        }
      }
      const bool rev = (sh.sweeps++ & 1) != 0;
      tm.barrier();  // gk complete (every member's columns; later stages added to it)
      for_panels(sh.ch, lay_.w2T.packed, rev, [&](int64_t a, int64_t b) { kern_.bwd1(g, lay_.w2T.panel(a, b)); });
      tm.barrier();  // gz complete
      for_panels(sh.cd, lay_.w1T.packed, rev, [&](int64_t a, int64_t b) { kern_.bwd2(g, lay_.w1T.panel(a, b)); });
      // dLoss/dtau_i = gk . w2[H] + gz . w1[d]; tau_i = t + c_i h; Y_i depends on h through
      // h * sum_j a_ij K_j.
      if (dt_row) {
        tm.barrier();  // gy complete
        for (int64_t r = 0; lead && r < rows; ++r) {
          const double gt = dot(g.gk + r * d, w2t, d) + dot(g.gz + r * H, w1t, H);
          dt_row[r] += gt;
          double acc = tab_.c[i] * gt;
          for (int j = 0; j < i; ++j) {
            if (tab_.a[i][j] != 0.0) acc += tab_.a[i][j] * dot(GY + r * d, st.k[j] + r * d, d);
          }
          dh_row[r] += acc;
        }
      }
    }
    tm.barrier();  // lam, GK, GZ complete; the lead is done with GY
  }

  // xt [n+2, R] = [x^T; tau; 1] for x [R, n]: rows c of x^T for the columns c of `cols`
  static void transpose_cols(T* xt, const T* x, int64_t R, int64_t n, const Cols& cols) {
    constexpr int64_t kBlock = 32;  // cache blocking
    for (int64_t r0 = 0; r0 < R; r0 += kBlock)
      for (int64_t c0 = cols.c0; c0 < cols.c1; c0 += kBlock)
        for (int64_t c = c0; c < std::min(cols.c1, c0 + kBlock); ++c)
          for (int64_t r = r0; r < std::min(R, r0 + kBlock); ++r) xt[c * R + r] = x[r * n + c];
  }
  // ... and its last two rows, tau and 1
  static void time_rows(T* xt, int64_t R, int64_t n, const T* tau) {
    std::memcpy(xt + n * R, tau, sizeof(T) * R);
    std::fill_n(xt + (n + 1) * R, R, T(1));
  }

  static double dot(const T* x, const T* y, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(y[i]);
    return s;
  }

 private:
  Dyn<T> dyn_;
  Layers<T> lay_;
  Tableau tab_;
  const T* times_;
  int64_t L_, n_;
  Kernels<T> kern_;
};

inline Chunk chunk_of(const Split& split, int64_t S, int64_t c) {
  Chunk ch;
  ch.r0 = c * split.chunk;
  ch.rows = std::min(split.chunk, S - ch.r0);
  ch.R = ch.rows <= 1 ? ch.rows : ch.rows + ch.rows % 2;  // even: register tiles of 2..12 rows
  return ch;
}

// The four products' weights. Team splits: packed panels (sized here, outside the parallel
// region; filled by the members, so each core's panels start in its own cache). Otherwise
// the matrices and, for the backward, transposed copies w2T [d, H] = w2[:H]^T,
// w1T [H, d] = w1[:d]^T, so that every product is a row update (mm_nn).
template <typename T>
Layers<T> make_layers(const Dyn<T>& dyn, bool team, LayerCopies<T>& cp, bool backward) {
  const int64_t d = dyn.d, H = dyn.H;
  Layers<T> lay;
  if (team) {
    cp.w1.resize(d * H);
    cp.w2.resize(H * d);
    lay.w1 = Weights<T>{cp.w1.data(), d, H, true};
    lay.w2 = Weights<T>{cp.w2.data(), H, d, true};
    if (backward) {
      cp.w2T.resize(d * H);
      cp.w1T.resize(H * d);
      lay.w2T = Weights<T>{cp.w2T.data(), d, H, true};
      lay.w1T = Weights<T>{cp.w1T.data(), H, d, true};
    }
    return lay;
  }
  lay.w1 = Weights<T>{dyn.w1, d, H, false};
  lay.w2 = Weights<T>{dyn.w2, H, d, false};
  if (backward) {
    cp.w2T.resize(d * H);
    cp.w1T.resize(H * d);
    for (int64_t c = 0; c < d; ++c)
      for (int64_t h = 0; h < H; ++h) {
        cp.w1T[h * d + c] = dyn.w1[c * H + h];
        cp.w2T[c * H + h] = dyn.w2[h * d + c];
      }
    lay.w2T = Weights<T>{cp.w2T.data(), d, H, false};
    lay.w1T = Weights<T>{cp.w1T.data(), H, d, false};
  }
  return lay;
}

// Threads for the chunks of a split without a team (cost: a chunk's multiply-adds). Their
// region obeys the contention fallback without judging by its end (few, unequal chunks).
inline int chunk_threads(const Split& split, int64_t L, int64_t d, int64_t H, const Options& opt) {
  const double stages = tableau(opt.method).stages;
  return team_threads(split.nchunks, 2.0 * split.chunk * L * opt.substeps * stages * d * H);
}

template <typename T>
void forward_impl(const T* p0, const Dyn<T>& dyn, const T* times, int64_t S, int64_t L, const Options& opt,
                  T* out, const Tape<T>& tape) {
  const int64_t d = dyn.d, H = dyn.H;
  if (S == 0 || L == 0 || d == 0) return;
  const Split split = split_states<T>(S, d, H);
  const Kernels<T> kern = kernels<T>();
  LayerCopies<T> cp;
  const Integrator<T> integ(dyn, make_layers(dyn, split.team, cp, false), opt, times, L, kern);
  if (split.team) {
    const Chunk ch = chunk_of(split, S, 0);
    integ.forward_chunk(p0, out, ch, team_size(ch.R, d, H, kern.block), &cp, tape);
    return;
  }
  for_each_item(
      chunk_threads(split, L, d, H, opt), split.nchunks,
      [&](int, int64_t c) { integ.forward_chunk(p0, out, chunk_of(split, S, c), 1, nullptr, tape); }, false);
}

template <typename T>
void backward_impl(const T* grad, const T* out, const T* p0, const Dyn<T>& dyn, const T* times, int64_t S,
                   int64_t L, const Options& opt, T* const* grads, Tape<T> tape) {
  T *dp0 = grads[0], *dw1 = grads[1], *db1 = grads[2], *dw2 = grads[3], *db2 = grads[4], *dtimes = grads[5];
  // The times' gradient needs every stage's slope K_i, which the tape does not hold: that
  // backward recomputes every interval.
  if (dtimes) tape.data = nullptr;
  const int64_t d = dyn.d, H = dyn.H;
  if (S == 0 || L == 0 || d == 0) return;  // outputs are zero-initialised by the caller
  const Split split = split_states<T>(S, d, H);
  const Kernels<T> kern = kernels<T>();
  std::vector<T> zeros(std::max(d, H) + 64, T(0));
  Dyn<T> dynb = dyn;
  dynb.zeros = zeros.data();
  LayerCopies<T> cp;
  const Integrator<T> integ(dynb, make_layers(dyn, split.team, cp, true), opt, times, L, kern);
  // The weight and time gradients a chunk accumulates into (nullptr: not needed): chunk 0
  // into the outputs, chunk c > 0 into its own partial (the needed arrays one after
  // another), added to the outputs in chunk order at the end.
  struct Grads {
    T* p[5];  // dw1, db1, dw2, db2, dtimes
  };
  const Grads outs{{dw1, db1, dw2, db2, dtimes}};
  const int64_t sizes[5] = {(d + 1) * H, H, (H + 1) * d, d, L};
  int64_t per = 0;
  for (int q = 0; q < 5; ++q) per += outs.p[q] ? sizes[q] : 0;
  std::vector<T> part(static_cast<size_t>((split.nchunks - 1) * per), T(0));
  auto grads_of = [&](int64_t c) {
    if (c == 0) return outs;
    Grads g{};
    T* base = part.data() + (c - 1) * per;
    for (int q = 0; q < 5; ++q) {
      g.p[q] = outs.p[q] ? base : nullptr;
      base += outs.p[q] ? sizes[q] : 0;
    }
    return g;
  };
  auto run = [&](int64_t c, int threads, LayerCopies<T>* copies) {
    const Grads g = grads_of(c);
    integ.backward_chunk(grad, out, p0, dp0, g.p[0], g.p[1], g.p[2], g.p[3], g.p[4], chunk_of(split, S, c), threads,
                         copies, tape);
  };
  if (split.team) {
    run(0, team_size(chunk_of(split, S, 0).R, d, H, kern.block), &cp);
  } else {
    for_each_item(chunk_threads(split, L, d, H, opt), split.nchunks, [&](int, int64_t c) { run(c, 1, nullptr); },
                  false);
  }
  // fixed-order reduction of the partials
  for (int64_t c = 1; c < split.nchunks; ++c) {
    const Grads g = grads_of(c);
    for (int q = 0; q < 5; ++q) {
      if (outs.p[q])
        for (int64_t e = 0; e < sizes[q]; ++e) outs.p[q][e] += g.p[q][e];
    }
  }
}

}  // namespace

// --- Entry points (floater_cpu.h) --------------------------------------------------------

namespace {

// The tape of a problem in `t` (undefined or empty: none); floater_ops.cpp checked its size.
template <typename T>
Tape<T> tape_of(const at::Tensor& t, const Inputs& in, const Options& opt) {
  Tape<T> tape;
  const int64_t per = tape_numel(in.p0.size(0), in.p0.size(1), in.w1.size(1), 1, opt);
  if (!t.defined() || t.numel() == 0 || per == 0) return tape;
  tape.data = t.data_ptr<T>();
  tape.intervals = t.numel() / per;
  tape.n = opt.substeps;
  tape.stages = tableau(opt.method).stages;
  tape.S = in.p0.size(0);
  tape.d = in.p0.size(1);
  tape.H = in.w1.size(1);
  return tape;
}

}  // namespace

int64_t tape_numel(int64_t S, int64_t d, int64_t H, int64_t intervals, const Options& opt) {
  return intervals * opt.substeps * tableau(opt.method).stages * S * (d + H);
}

void forward_cpu(const Inputs& in, const Options& opt, at::Tensor& out, const at::Tensor& tape) {
  const int64_t S = in.p0.size(0), d = in.p0.size(1), H = in.w1.size(1), L = in.times.size(0);
  AT_DISPATCH_FLOATING_TYPES(in.p0.scalar_type(), "floater_integrate_cpu", [&] {
    const Dyn<scalar_t> dyn{in.w1.data_ptr<scalar_t>(), in.b1.data_ptr<scalar_t>(), in.w2.data_ptr<scalar_t>(),
                            in.b2.data_ptr<scalar_t>(), d, H, opt.act};
    forward_impl<scalar_t>(in.p0.data_ptr<scalar_t>(), dyn, in.times.data_ptr<scalar_t>(), S, L, opt,
                           out.data_ptr<scalar_t>(), tape_of<scalar_t>(tape, in, opt));
  });
}

void backward_cpu(const at::Tensor& grad, const at::Tensor& out, const Inputs& in, const Options& opt,
                  std::array<at::Tensor, 6>& grads, const at::Tensor& tape) {
  const int64_t S = in.p0.size(0), d = in.p0.size(1), H = in.w1.size(1), L = in.times.size(0);
  AT_DISPATCH_FLOATING_TYPES(in.p0.scalar_type(), "floater_integrate_backward_cpu", [&] {
    scalar_t* g[6];
    for (int i = 0; i < 6; ++i) g[i] = grads[i].defined() ? grads[i].data_ptr<scalar_t>() : nullptr;
    const Dyn<scalar_t> dyn{in.w1.data_ptr<scalar_t>(), in.b1.data_ptr<scalar_t>(), in.w2.data_ptr<scalar_t>(),
                            in.b2.data_ptr<scalar_t>(), d, H, opt.act};
    backward_impl<scalar_t>(grad.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), in.p0.data_ptr<scalar_t>(), dyn,
                            in.times.data_ptr<scalar_t>(), S, L, opt, g, tape_of<scalar_t>(tape, in, opt));
  });
}

int64_t set_backward_keep_budget(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0, "backward keep budget must be >= 0, got ", bytes);
  return g_keep_budget.exchange(bytes);
}

}  // namespace floater
}  // namespace posenc_fast
