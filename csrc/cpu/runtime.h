// The CPU runtime in one include, for the drivers of the per-instruction-set kernels (LFF,
// encodings, rotary): instruction-set selection (isa.h), portable vectors and float32 math
// (vec.h), storage dtypes and buffers (tensors.h), the parallel region (parallel.h), and
// every system header the per_isa.h kernels use (compiled inside namespaces, they include none).
#pragma once

// GCC 12 reports its own AVX-512 intrinsic headers' deliberately undefined temporaries
// (masked loads, roundscale) as maybe-uninitialized once inlined into the kernels: noise.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "cpu/tensors.h"
#include "cpu/vec.h"
