// Hooks of the CUDA FLOATER sources (floater_cuda.cu, floater_cuda_team.cuh,
// floater_cuda_products.cuh) for a tool that compiles them for something other than a GPU:
// tools/cuda_emulation runs them on the CPU, one std::thread per CUDA thread, with a race
// checker. Such a tool defines these macros before the sources are read (the emulation
// force-includes its header, -include cuda_emulation.h) and provides what the CUDA headers
// declare (cuda_runtime.h, cooperative_groups.h, cuda_pipeline.h). Each defaults to the
// GPU build's behaviour; none changes the kernels' arithmetic. csrc/README.md, "Hooks".
//
//   FLOATER_CUDA_THREADS                    threads per block (256; a multiple of 32)
//   FLOATER_CUDA_DYNAMIC_SMEM(name)         declares the block's dynamic shared memory `name`
//   FLOATER_CUDA_ACCESS(p, bytes, write)    before every access to a team's exchange buffers
//                                           (xload, xstore, load_vec, remote stores): nothing
//   FLOATER_CUDA_EXCHANGE_BUFFER(p, bytes)  before a grid team's persistent launch: nothing
//   FLOATER_CUDA_NO_INLINE_PTX              defined: stores into another block's shared
//                                           memory through map_shared_rank, not inline PTX
#pragma once

#ifndef FLOATER_CUDA_THREADS
#define FLOATER_CUDA_THREADS 256
#endif
#ifndef FLOATER_CUDA_DYNAMIC_SMEM
#define FLOATER_CUDA_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif
#ifndef FLOATER_CUDA_ACCESS
#define FLOATER_CUDA_ACCESS(p, bytes, write) ((void)0)
#endif
#ifndef FLOATER_CUDA_EXCHANGE_BUFFER
#define FLOATER_CUDA_EXCHANGE_BUFFER(p, bytes) ((void)0)
#endif
