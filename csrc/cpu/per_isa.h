// Compiles the kernel header named by PF_ISA_KERNELS once per instruction set, each copy in
// its own namespace (isa_avx512, isa_avx2, isa_generic) with kBytes (vector width) and kRegs
// (vector registers) defined, and the whole copy compiled for that target: intrinsics can
// then be used in every helper, not only in target-attributed entry points (GCC refuses to
// inline a target-specific always_inline function into a helper without that target).
// Used by the LFF, encoding and rotary drivers; FLOATER's kernels are compiled per set by
// target attributes instead (floater_kernels.h: they keep the build's contraction, below).
//
// Floating-point contraction is off inside these regions (FLOATER keeps the build's
// -ffp-contract=fast): every fused multiply-add is an explicit vfma(). Why: contraction
// depends on the target, and the error-free phase reduction needs its products rounded
// where the Triton kernels round them (triton_kernels/_phase.py, enable_fp_fusion=False);
// so every instruction set computes bitwise the same numbers (tests/lff/test_cpp_fourier.py).
//
// Included once by each driver .cpp that defines PF_ISA_KERNELS (no include guard), inside
// the driver's namespace, after the driver's types: the kernel headers (and cpu/simd.h,
// cpu/phase.h, which they include) include no system header; cpu/runtime.h, included at
// the top of the driver, brings all they need. PF_ISA_TABLE(name) then picks a kernel
// table (cpu/isa.h's choice).
#if !defined(PF_ISA_KERNELS)
#error "define PF_ISA_KERNELS (the kernel header to compile per instruction set) first"
#endif
#if defined(__clang__)
#pragma clang fp contract(off)
#define PF_ISA_BEGIN(TARGET) _Pragma(PF_ISA_STR(clang attribute push(__attribute__((target(TARGET))), apply_to = function)))
#define PF_ISA_END _Pragma("clang attribute pop")
#define PF_ISA_STR(x) #x
#elif defined(__GNUC__)
#define PF_ISA_BEGIN(TARGET) _Pragma("GCC push_options") _Pragma(PF_ISA_STR(GCC target(TARGET))) \
  _Pragma("GCC optimize(\"fp-contract=off\")")
#define PF_ISA_END _Pragma("GCC pop_options")
#define PF_ISA_STR(x) #x
#else
#error "posenc_fast's C++ CPU kernels need GCC or Clang"
#endif

namespace {

#if defined(__x86_64__) || defined(_M_X64)
#define PF_X86 1
PF_ISA_BEGIN("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,f16c,bmi2,prfchw")
#define PF_VEC_BYTES 64
namespace isa_avx512 {
constexpr int kBytes = 64;
constexpr int kRegs = 32;
#include PF_ISA_KERNELS
}  // namespace isa_avx512
#undef PF_VEC_BYTES
PF_ISA_END

PF_ISA_BEGIN("avx2,fma,f16c,bmi2")
#define PF_VEC_BYTES 32
namespace isa_avx2 {
constexpr int kBytes = 32;
constexpr int kRegs = 16;
#include PF_ISA_KERNELS
}  // namespace isa_avx2
#undef PF_VEC_BYTES
PF_ISA_END
#endif

#if defined(__clang__)
namespace isa_generic {
#else
_Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=off\")")
namespace isa_generic {
#endif
#define PF_VEC_BYTES 16
constexpr int kBytes = 16;
constexpr int kRegs = 16;
#include PF_ISA_KERNELS
}  // namespace isa_generic
#undef PF_VEC_BYTES
#if !defined(__clang__)
_Pragma("GCC pop_options")
#endif

}  // namespace

#undef PF_ISA_BEGIN
#undef PF_ISA_END
#undef PF_ISA_STR

// The kernel table NAME compiled for the instruction set in use (cpu/isa.h).
#if defined(PF_X86)
#define PF_ISA_TABLE(NAME)                                                            \
  (::posenc_fast::cpu::isa_level() == 2 ? isa_avx512::NAME                            \
                                        : (::posenc_fast::cpu::isa_level() == 1 ? isa_avx2::NAME : isa_generic::NAME))
#else
#define PF_ISA_TABLE(NAME) (isa_generic::NAME)
#endif
