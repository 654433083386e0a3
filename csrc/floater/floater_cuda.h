// Launchers of the CUDA FLOATER integrator (floater_cuda.cu). Plain pointers and a stream:
// no torch types, so nvcc compiles the kernels without torch's headers; the torch-facing
// glue (checks, allocation, CUDAGuard, current stream, the weight-gradient GEMMs) is
// floater_cuda_ops.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace posenc_fast {
namespace floater {
namespace cuda {

struct Problem {
  int64_t S, d, H, L, substeps;
  int method;      // Method
  int activation;  // Activation
  int dtype_size;  // 4 (float32) or 8 (float64)
  bool backward;   // the adjoint kernel (else the forward kernel)
  bool needs[6];   // backward: p0, w1, b1, w2, b2, times
  int64_t chunk_intervals = 0;  // backward: intervals per chunk (0: automatic; tests set it)
};

// How the work is laid out on the device (chosen by choose_layout(), from the problem and the
// device's properties only: never from timing).
struct Layout {
  int mode;        // 0: solo (one block per team), 1: cluster (sm_90+), 2: cooperative grid
  int C;           // blocks per team (they split the dynamics' weights)
  int G;           // teams (each integrates Sg of the S states)
  int Sg;          // states per team
  int kr1, kr2;    // rows of a block's slice of w1 / w2 held in shared memory (the rest: L2)
  bool stage_x;    // grid: exchanged vectors copied into shared memory (else read from L2)
  size_t smem_bytes;
  size_t workspace_bytes;  // global scratch of the kernel (grid exchange buffers)
  double stage_ns;         // choose_layout's predicted time of one stage (an estimate)
  char why[200];   // human-readable summary (for errors, benchmarks and debugging)
};

// Returns cudaSuccess and fills layout, or an error (e.g. sizes beyond what fits).
cudaError_t choose_layout(const Problem& pr, int device, Layout* layout);

// The layout of given choices (mode, C, Sg, the fraction of each weight slice's rows held in
// shared memory, stage_x) without asking the device whether it fits: for tests, the CPU
// emulation (tools/cuda_emulation) and forced layouts (set_forced_layout).
cudaError_t layout_for(const Problem& pr, int mode, int C, int Sg, double resident, Layout* layout,
                       bool stage_x = true);

struct Pointers {
  const void *p0, *w1, *b1, *w2, *b2, *times;
  void* out;                                        // forward: [S, L, d]
  const void *grad, *out_saved;                     // backward inputs [S, L, d]
  void *dp0, *dw1, *db1, *dw2, *db2, *dtimes;       // backward outputs (null: not needed);
                                                    // dw1..db2 zero-filled by the caller
  void* workspace;                                  // forward_workspace_bytes /
                                                    // backward_workspace_bytes, any content
};

// The tape (the forward's stage values, the layout of the CPU tape: Y [intervals][substeps]
// [stages][S][d], then Z [intervals][substeps][stages][S][H]).
struct TapeRef {
  void* data;          // null: none
  int64_t intervals;   // the first `intervals` intervals are on it
};
int64_t tape_numel(int64_t S, int64_t d, int64_t H, int64_t intervals, int64_t substeps, int method);

size_t forward_workspace_bytes(const Problem& pr, const Layout& layout);
// The forward: out, and the stage values of tape.intervals intervals into tape.data.
cudaError_t forward(const Problem& pr, const Layout& layout, const Pointers& ptr, TapeRef tape, cudaStream_t stream);

// Where the backward's weight gradients are made: after the adjoint chain of a chunk of
// intervals, one call per layer with its stage values X (layer 1: the stage inputs Y
// [rows][d]; layer 2: the pre-activations Z [rows][H], through the activation) and the
// gradients G at the layer's output (layer 1: dLoss/dz [rows][H]; layer 2: dLoss/dk
// [rows][d]), rows = stages x S (stage-major), taus [stages] the stage times. The layer's
// weight gradient gets dw[:K] += X^T G and its time row dw[K] += taus^T (G summed over the
// S states of each stage), its bias db += G summed over rows: a few large GEMMs
// (floater_cuda_ops.cpp: ATen on the current stream; the CPU emulation: loops).
struct GradSink {
  virtual ~GradSink() = default;
  virtual cudaError_t layer(int layer, const void* X, const void* G, const void* taus, int64_t stages,
                            int64_t K, int64_t N) = 0;
};

// The backward (the discrete adjoint by chunks of intervals: floater_cuda.cu's header).
// flayout: the forward's layout, which re-tapes intervals beyond the tape (bitwise the forward's
// stage values); alayout: the adjoint chain's. A gradient of the times re-tapes every chunk.
size_t backward_workspace_bytes(const Problem& pr, const Layout& flayout, const Layout& alayout, TapeRef tape);
cudaError_t backward(const Problem& pr, const Layout& flayout, const Layout& alayout, const Pointers& ptr, TapeRef tape,
                     GradSink& sink, cudaStream_t stream);

// Every layout the CUDA ops chose in this process, one line each (the problem, then
// Layout::why): what the benchmarks record (floater_cuda_ops.cpp).
std::vector<std::string> layout_log();

// Force a layout on the CUDA ops instead of choose_layout()'s choice: "mode,C,Sg[,resident[,staged]]"
// (mode solo, cluster or grid; "" for the automatic choice); returns the previous one. For
// tests and experiments on a GPU (module_cuda.cpp: set_development_options).
std::string set_forced_layout(const std::string& spec);
std::string forced_layout_spec();  // the forced layout, "" for none

int compiled_version();  // CUDART_VERSION the kernels were compiled with
int runtime_version();   // the CUDA runtime's version, -1 if it cannot tell (floater_cuda_ops.cpp)

}  // namespace cuda
}  // namespace floater
}  // namespace posenc_fast
