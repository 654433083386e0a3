// FLOATER integrator: definitions shared by the CPU (floater_cpu.cpp) and CUDA
// (floater_cuda.cu) kernels. No torch headers here, so nvcc compiles the kernels
// without them.
//
// The problem (the contract of the backends in posenc_fast/ops/floater/registry.py):
//   p0    [S, d]     initial states
//   w1    [d+1, H]   z = p @ w1[:d] + t * w1[d] + b1
//   b1    [H]        a = act(z)
//   w2    [H+1, d]   f(t, p) = a @ w2[:H] + t * w2[H] + b2
//   b2    [d]
//   times [L]        non-decreasing sample times; interval j goes from
//                    (j == 0 ? 0 : times[j-1]) to times[j] in `substeps` equal steps
//   out   [S, L, d]  out[:, j] = state at times[j]
// All tensors contiguous, one dtype (float32 or float64), one device.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PF_HOST_DEVICE inline
#endif

namespace posenc_fast {
namespace floater {

enum class Method : int { Euler = 0, Midpoint = 1, RK4 = 2, RK38 = 3 };
enum class Activation : int { ReLU = 0, Tanh = 1, GELU = 2, Identity = 3 };

constexpr int kMaxStages = 4;

// The options of one integration: the op's (substeps, method, activation), parsed.
struct Options {
  int64_t substeps;  // equal steps per interval
  Method method;
  Activation act;
};

// Explicit Runge-Kutta tableau: stage i is evaluated at t + c[i] h on
// p + h * sum_{j<i} a[i][j] k_j; the step is p + h * sum_i b[i] k_i.
struct Tableau {
  int stages;
  double a[kMaxStages][kMaxStages];
  double b[kMaxStages];
  double c[kMaxStages];
};

PF_HOST_DEVICE Tableau tableau(Method m) {
  Tableau t{};
  switch (m) {
    case Method::Euler:
      t.stages = 1;
      t.b[0] = 1.0;
      break;
    case Method::Midpoint:
      t.stages = 2;
      t.a[1][0] = 0.5;
      t.b[1] = 1.0;
      t.c[1] = 0.5;
      break;
    case Method::RK4:
      t.stages = 4;
      t.a[1][0] = 0.5;
      t.a[2][1] = 0.5;
      t.a[3][2] = 1.0;
      t.b[0] = 1.0 / 6.0;
      t.b[1] = 1.0 / 3.0;
      t.b[2] = 1.0 / 3.0;
      t.b[3] = 1.0 / 6.0;
      t.c[1] = 0.5;
      t.c[2] = 0.5;
      t.c[3] = 1.0;
      break;
    case Method::RK38:  // Kutta's 3/8 rule (torchdiffeq's fixed-step "rk4")
      t.stages = 4;
      t.a[1][0] = 1.0 / 3.0;
      t.a[2][0] = -1.0 / 3.0;
      t.a[2][1] = 1.0;
      t.a[3][0] = 1.0;
      t.a[3][1] = -1.0;
      t.a[3][2] = 1.0;
      t.b[0] = 1.0 / 8.0;
      t.b[1] = 3.0 / 8.0;
      t.b[2] = 3.0 / 8.0;
      t.b[3] = 1.0 / 8.0;
      t.c[1] = 1.0 / 3.0;
      t.c[2] = 2.0 / 3.0;
      t.c[3] = 1.0;
      break;
  }
  return t;
}

// Step k of interval j starts at t_prev + k * h, h = (times[j] - t_prev) / substeps.
// Its derivatives: dt_k/dtimes[j] = k/n, dt_k/dt_prev = 1 - k/n, dh/dtimes[j] = 1/n,
// dh/dt_prev = -1/n (used by the backward for the gradient of the times).

}  // namespace floater
}  // namespace posenc_fast
