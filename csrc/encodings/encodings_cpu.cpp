// Sinusoidal and DFT encodings on the CPU: the table, the fused add x + pe (x read once, the
// sum written once) and the gradient to the positions.
//
// Shapes: positions p [L] (any real dtype, strided); x / out [R, dim] with R = B * L:
// row b * L + l holds position l (B = 1 unless positions [L] are broadcast over the
// leading dimensions of x [..., L, dim]); grad [L, dim] -> dp [L].
//
// Design: the spectrum (frequencies in turns, amplitudes, the block term) is built here in
// float64 from the same formulas as triton_kernels/encodings.py and split into float32
// pairs; encodings_kernels.h computes each position's row once (phases with the error-free
// reduction, one sincos per frequency) into a row buffer in L1 and writes it to its B
// output rows (adding x's rows): a broadcast position is encoded once, and x and the output
// stream through memory once. Threads take runs of positions (cpu/parallel.h). The gradient
// sums over frequencies in 16 virtual lanes: the same bits on every ISA and thread count.
#include "encodings/encodings_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/runtime.h"

namespace posenc_fast {
namespace encodings {
namespace {

using namespace ::posenc_fast::cpu;

enum class PT { F32, BF16, F16, I8, U8, I16, I32, I64 };  // position dtypes

// The spectrum as float32 rows the kernels read (zero beyond K), and the constants.
struct EncTables {
  const float *nu_hi, *nu_lo;  // [K] frequency in turns per unit position: hi + lo
  const float* dphase;         // [K] 2 pi nu amp: d(amp cos)/dp = -dphase sin, d(amp sin)/dp = dphase cos
  const float* bias;           // [dim] the block term (FLOATER Eq. 7) or nullptr
  float amp;                   // amplitude of every cos and sin (1 for sinusoidal)
  float a0;                    // dft: column 0 and the amplitude of column dim-1
  float half_dcos;             // dft: pi a0, the derivative factor of column dim-1
};

struct EncIO {
  const void* p;  // positions: element l at p + l * sp
  PT pt;
  bool pos_int;
  int64_t sp;
  const void* x;  // [R, dim] row stride ldx, or nullptr (the table)
  DT xdt;
  int64_t ldx;
  void* out;  // [R, dim] row stride ldo
  DT odt;
  int64_t ldo;
  bool stream;  // whole output vectors by streaming stores (cpu/tensors.h: use_streaming)
  const void* grad;  // backward [L, dim] row stride ldg
  DT gdt;
  int64_t ldg;
  void* dp;  // backward [L], dtype dpdt
  DT dpdt;
};

// Positions encoded together into a thread's buffer, then written batch by batch.
constexpr int64_t kRunPositions = 16;

struct EncCall {
  int64_t dim, K, L, B;
  int64_t ldrow;  // row stride of the encoding buffer
  bool dft;
  EncTables t;
  EncIO io;
};

struct EncKernels {
  void (*forward)(const EncCall& c, int64_t l0, int64_t l1, float* buf);
  void (*backward)(const EncCall& c, int64_t l0, int64_t l1);
};

}  // namespace

#define PF_ISA_KERNELS "encodings/encodings_kernels.h"
#include "cpu/per_isa.h"
#undef PF_ISA_KERNELS

namespace {

const EncKernels& enc_kernels() { return PF_ISA_TABLE(kEncKernels); }

PT pt_of(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return PT::BF16;
    case at::kHalf:
      return PT::F16;
    case at::kChar:
      return PT::I8;
    case at::kByte:
      return PT::U8;
    case at::kShort:
      return PT::I16;
    case at::kInt:
      return PT::I32;
    case at::kLong:
      return PT::I64;
    default:
      return PT::F32;
  }
}

constexpr double kTwoPi = 6.283185307179586;

// The spectrum of (kind, dim, base) in float64, as triton_kernels/encodings.py's _spectrum:
// sinusoidal nu_i = base^(-2i/dim) / (2 pi), i < dim/2; dft nu_k = k / dim, k = 1..dim/2-1.
struct Spectrum {
  std::vector<double> nu;
  double amp;
};
Spectrum spectrum(Kind kind, int64_t dim, double base) {
  Spectrum s;
  if (kind == Kind::Sinusoidal) {
    s.amp = 1.0;
    for (int64_t i = 0; i < dim / 2; ++i) s.nu.push_back(std::pow(base, -2.0 * static_cast<double>(i) / dim) / kTwoPi);
  } else {
    s.amp = std::sqrt(2.0 / dim);
    for (int64_t k = 1; k < dim / 2; ++k) s.nu.push_back(static_cast<double>(k) / dim);
  }
  return s;
}

// The float32 tables in `store` (zero-padded), and the block term: the encoding of position
// `block` in float64 with the phase reduced before the trig, rounded to float32.
EncTables make_tables(const Spec& spec, at::Tensor& store) {
  const int64_t dim = spec.dim;
  const Spectrum s = spectrum(spec.kind, dim, spec.base);
  const int64_t K = static_cast<int64_t>(s.nu.size()), ldk = round_up(std::max<int64_t>(K, 1));
  const int64_t ldb = round_up(dim) + kPad;
  store = zeroed_floats(3 * ldk + ldb);
  float* base_ptr = store.data_ptr<float>();
  float *hi = base_ptr, *lo = hi + ldk, *dphase = lo + ldk, *bias = dphase + ldk;
  for (int64_t k = 0; k < K; ++k) {
    hi[k] = static_cast<float>(s.nu[k]);
    lo[k] = static_cast<float>(s.nu[k] - static_cast<double>(hi[k]));
    dphase[k] = static_cast<float>(kTwoPi * s.nu[k] * s.amp);
  }
  const double a0 = 1.0 / std::sqrt(static_cast<double>(dim));
  EncTables t{hi, lo, dphase, nullptr, static_cast<float>(s.amp), static_cast<float>(a0),
              static_cast<float>(M_PI * a0)};
  if (spec.block) {
    auto angle = [&](double nu) {
      const double turns = nu * *spec.block;
      return kTwoPi * (turns - std::nearbyint(turns));
    };
    for (int64_t k = 0; k < K; ++k) {
      const double a = angle(s.nu[k]);
      if (spec.kind == Kind::Sinusoidal) {
        bias[2 * k] = static_cast<float>(std::sin(a));
        bias[2 * k + 1] = static_cast<float>(std::cos(a));
      } else {
        bias[1 + k] = static_cast<float>(std::cos(a) * s.amp);
        bias[1 + K + k] = static_cast<float>(std::sin(a) * s.amp);
      }
    }
    if (spec.kind == Kind::DFT) {
      bias[0] = static_cast<float>(a0);
      bias[dim - 1] = static_cast<float>(std::cos(angle(0.5)) * a0);
    }
    t.bias = bias;
  }
  return t;
}

EncCall make_call(const at::Tensor& p, const Spec& spec, at::Tensor& store) {
  EncCall c{};
  c.dim = spec.dim;
  c.dft = spec.kind == Kind::DFT;
  c.t = make_tables(spec, store);
  c.K = c.dft ? spec.dim / 2 - 1 : spec.dim / 2;
  c.io.p = p.data_ptr();
  c.io.pt = pt_of(p.scalar_type());
  c.io.pos_int = !at::isFloatingType(p.scalar_type());
  c.io.sp = p.stride(0);
  return c;
}

}  // namespace

at::Tensor forward_cpu(const at::Tensor& p, int64_t period, const at::Tensor& x, const Spec& spec,
                       at::ScalarType out_dtype) {
  const int64_t R = x.defined() ? x.size(0) : p.size(0), dim = spec.dim;
  at::Tensor out = new_output({R, dim}, p.options().dtype(out_dtype));
  if (R == 0 || dim == 0) return out;
  at::Tensor store;
  EncCall c = make_call(p, spec, store);
  c.L = period > 0 ? period : R;
  c.B = R / c.L;
  if (x.defined()) {
    c.io.x = x.data_ptr();
    c.io.xdt = dt_of(x.scalar_type());
    c.io.ldx = x.stride(0);
  }
  c.io.out = out.data_ptr();
  c.io.odt = dt_of(out_dtype);
  c.io.ldo = out.stride(0);
  c.io.stream = use_streaming(out);
  // Runs of kRunPositions positions, or fewer when that leaves a thread idle.
  const WorkSplit w = split_work(c.L, kRunPositions, 1, 30.0 * c.K + c.B * dim);
  c.ldrow = round_up(dim) + 2 * kPad;
  const at::Tensor bufs = at::empty({w.threads * kRunPositions * c.ldrow}, at::kFloat);
  const EncKernels& kern = enc_kernels();
  for_each_item(w.threads, w.items, [&](int rank, int64_t q) {
    kern.forward(c, q * w.size, std::min(c.L, (q + 1) * w.size), bufs.data_ptr<float>() + rank * kRunPositions * c.ldrow);
  });
  return out;
}

at::Tensor backward_cpu(const at::Tensor& grad, const at::Tensor& p, const Spec& spec) {
  const int64_t L = p.size(0);
  // the positions' dtype; float32 for integer positions
  const bool fp = at::isFloatingType(p.scalar_type());
  at::Tensor dp = at::empty({L}, p.options().dtype(fp ? p.scalar_type() : at::kFloat));
  if (L == 0) return dp;
  at::Tensor store;
  EncCall c = make_call(p, Spec{spec.dim, spec.kind, spec.base, c10::nullopt}, store);
  c.L = L;
  c.B = 1;
  c.io.grad = grad.data_ptr();
  c.io.gdt = dt_of(grad.scalar_type());
  c.io.ldg = grad.stride(0);
  c.io.dp = dp.data_ptr();
  c.io.dpdt = dt_of(dp.scalar_type());
  const int64_t run = 64;
  const int64_t runs = (L + run - 1) / run;
  const int threads = team_threads(runs, run * 35.0 * c.K);
  const EncKernels& kern = enc_kernels();
  for_each_item(threads, runs, [&](int, int64_t q) { kern.backward(c, q * run, std::min(L, (q + 1) * run)); });
  return dp;
}

}  // namespace encodings
}  // namespace posenc_fast
