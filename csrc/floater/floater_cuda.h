// Launchers of the CUDA FLOATER integrator (floater_cuda.cu). Plain pointers and a stream:
// no torch types, so nvcc compiles the kernels without torch's headers; the torch-facing
// glue (checks, allocation, CUDAGuard, current stream) is floater_cuda_ops.cpp.
#pragma once

#if defined(POSENC_FAST_CUDA_EMULATION)
#include "cuda_emulation.h"
#else
#include <cuda_runtime.h>
#endif

#include <cstddef>
#include <cstdint>

namespace posenc_fast {
namespace floater {
namespace cuda {

struct Problem {
  int64_t S, d, H, L, substeps;
  int method;      // Method
  int activation;  // Activation
  int dtype_size;  // 4 (float32) or 8 (float64)
  bool backward;
  bool needs[6];   // backward: p0, w1, b1, w2, b2, times
};

// How the work is laid out on the device (chosen by plan(), from the problem and the
// device's properties only: never from timing).
struct Plan {
  int mode;        // 0: solo (one block per team), 1: cluster (sm_90), 2: cooperative grid
  int C;           // blocks per team (they split the dynamics' weights)
  int G;           // teams (each integrates Sg of the S states)
  int Sg;          // states per team
  bool resident;   // weights held in shared memory (else read from L2 at every stage)
  bool stage_x;    // exchanged vectors copied into shared memory (else read from L2)
  int ld1, ld2;    // shared-memory row strides of the weight slices (odd: no bank conflicts)
  size_t smem_bytes;
  size_t workspace_bytes;  // global scratch, zero-filled by the caller
  char why[160];   // human-readable summary (for errors and debugging)
};

// Returns cudaSuccess and fills plan, or an error (e.g. sizes beyond what fits).
cudaError_t plan(const Problem& pr, int device, Plan* plan);

// A plan for a given layout (mode, blocks per team C, states per team Sg, weights resident
// in shared memory or not), without asking the device whether it fits: for tests, the
// CPU emulation (tools/cuda_emulation) and POSENC_FAST_CUDA_PLAN experiments on a GPU.
cudaError_t plan_with(const Problem& pr, int mode, int C, int Sg, bool resident, Plan* plan,
                      bool stage_x = true);

struct Pointers {
  const void *p0, *w1, *b1, *w2, *b2, *times;
  void* out;                                        // forward: [S, L, d]
  const void *grad, *out_saved;                     // backward inputs [S, L, d]
  void *dp0, *dw1, *db1, *dw2, *db2, *dtimes;       // backward outputs (null: not needed),
                                                    // zero-filled by the caller
  void* workspace;
};

cudaError_t launch(const Problem& pr, const Plan& plan, const Pointers& ptr, cudaStream_t stream);

int compiled_version();  // CUDART_VERSION the kernels were compiled with
int runtime_version();   // the CUDA runtime's version, -1 if it cannot tell (floater_cuda_ops.cpp)

}  // namespace cuda
}  // namespace floater
}  // namespace posenc_fast
