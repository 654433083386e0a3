// Register-blocked float32 matrix product of the fused LFF MLP, for one instruction set
// (included per set by lff_kernels.h after cpu/simd.h; no include guard, no system headers):
//
//   C[i, j] = (acc ? C[i, j] : init[j]) + sum_{k < K} A(i, k) * B[k, j],  i < m, j < n
//
// A(i, k) = a[i * sai + k * sak]: any strides, so A can be a matrix or its transpose (the
// weight gradients X^T G read X's rows as A's columns). B is row-major (ldb), its rows read
// as vectors; C is row-major (ldc), stored in dtype dt (the output's, or float32).
//
// Register tiles of RT rows x CV vectors of C: per k, CV loads of B and RT broadcasts of A
// feed RT * CV fused multiply-adds. Every element of C is the same chain
// init -> fma(A(i, 0), B[0, j]) -> ... -> fma(A(i, K-1), B[K-1, j]) whatever the tile shape,
// the vector width or the position of the element: the results are bitwise independent
// of the instruction set, of the row tiling and of how rows are split across threads.

struct Gemm {
  const float* a;
  int64_t sai, sak;    // A(i, k) = a[i * sai + k * sak]
  const float* b;
  int64_t ldb;         // B [K, n]
  const float* init;   // [n] start values when !acc (nullptr: zero)
  bool acc;            // start from C itself (float32 C only)
  void* c;
  int64_t ldc;         // C [m, n]
  int64_t m, n, K;
  bool stream = false;  // whole vectors of C by streaming stores (C aligned: simd.h's put)
};

// Rows per register tile for CV vectors of columns: ~24 accumulators with 32 vector
// registers (AVX-512), ~12 with 16 (the rest hold CV B vectors and a broadcast).
template <int CV>
constexpr int row_tile() {
  return kRegs >= 32 ? (CV >= 4 ? 6 : 12) : (CV >= 4 ? 2 : (CV == 2 ? 6 : 8));
}

template <int RT, int CV, bool FULL, DT dt>
PF_INLINE void gemm_tile(const Gemm& g, int64_t i0, int64_t j0, int nn) {
  int nv[CV];
  for (int c = 0; c < CV; ++c) {
    const int left = nn - c * W;
    nv[c] = FULL ? W : (left < 0 ? 0 : (left > W ? W : left));
  }
  const size_t esize = dt == DT::F32 ? 4 : 2;
  char* crow = static_cast<char*>(g.c) + (i0 * g.ldc) * static_cast<int64_t>(esize);
  const int64_t crow_bytes = g.ldc * static_cast<int64_t>(esize);
  V acc[RT][CV];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CV; ++c) {
      if (g.acc)
        acc[r][c] = load_n(reinterpret_cast<const float*>(crow + r * crow_bytes) + j0 + c * W, nv[c]);
      else
        acc[r][c] = g.init ? load_n(g.init + j0 + c * W, nv[c]) : splat(0.0f);
    }
  const float* arow[RT];
  for (int r = 0; r < RT; ++r) arow[r] = g.a + (i0 + r) * g.sai;
  const float* brow = g.b + j0;
  for (int64_t k = 0; k < g.K; ++k, brow += g.ldb) {
    V bv[CV];
    for (int c = 0; c < CV; ++c) bv[c] = FULL ? vload(brow + c * W) : load_n(brow + c * W, nv[c]);
    for (int r = 0; r < RT; ++r) {
      const V av = splat(arow[r][k * g.sak]);
      for (int c = 0; c < CV; ++c) acc[r][c] = vfma(av, bv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CV; ++c) {
      put<dt>(crow + r * crow_bytes, j0 + c * W, acc[r][c], nv[c], g.stream);
    }
}

// Columns [j0, j0 + nn) for every row: full row tiles, then tiles of 4, 2 and 1 rows.
template <int CV, bool FULL, DT dt>
PF_INLINE void gemm_cols(const Gemm& g, int64_t j0, int nn) {
  constexpr int RT = row_tile<CV>();
  int64_t i = 0;
  for (; i + RT <= g.m; i += RT) gemm_tile<RT, CV, FULL, dt>(g, i, j0, nn);
  if (RT > 4 && i + 4 <= g.m) {
    gemm_tile<4, CV, FULL, dt>(g, i, j0, nn);
    i += 4;
  }
  if (RT > 2 && i + 2 <= g.m) {
    gemm_tile<2, CV, FULL, dt>(g, i, j0, nn);
    i += 2;
  }
  for (; i < g.m; ++i) gemm_tile<1, CV, FULL, dt>(g, i, j0, nn);
}

// Column blocks of 4 vectors (a block of B rows stays in L1 while every row tile of C
// passes), then the remaining columns as 1, 2 or 4 vectors, the last one partial.
template <DT dt>
PF_INLINE void gemm(const Gemm& g) {
  int64_t j = 0;
  for (; j + 4 * W <= g.n; j += 4 * W) gemm_cols<4, true, dt>(g, j, 4 * W);
  const int rest = static_cast<int>(g.n - j);
  if (rest == 0) return;
  if (rest <= W)
    rest == W ? gemm_cols<1, true, dt>(g, j, rest) : gemm_cols<1, false, dt>(g, j, rest);
  else if (rest <= 2 * W)
    rest == 2 * W ? gemm_cols<2, true, dt>(g, j, rest) : gemm_cols<2, false, dt>(g, j, rest);
  else
    gemm_cols<4, false, dt>(g, j, rest);
}
