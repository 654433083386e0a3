// The instruction set every C++ CPU kernel runs with (FLOATER, LFF, encodings, rotary): the
// best the CPU supports, lowered by POSENC_FAST_CPU_ISA=avx2|generic (read once) or by a
// process-wide override (set_isa, for tests: every path on one machine; "auto" clears it).
// Levels: 0 generic (the baseline x86-64 or the host's), 1 avx2 (+ FMA, F16C), 2 avx512
// (F, VL, DQ, BW), read with isa_level() at each call: an override acts at the next call.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

namespace posenc_fast {
namespace cpu {

inline const char* const* isa_names() {
  static const char* const names[] = {"generic", "avx2", "avx512"};
  return names;
}

inline int isa_from_name(const std::string& name) {
  for (int i = 0; i < 3; ++i)
    if (name == isa_names()[i]) return i;
  return -1;
}

inline int best_isa() {
  static const int best = [] {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
      return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
  }();
  return best;
}

inline std::atomic<int>& isa_override() {  // -1: unset; else a level
  static std::atomic<int> level{-1};
  return level;
}

// The active level: the override, else POSENC_FAST_CPU_ISA, else the best; never above
// the best the CPU supports.
inline int isa_level() {
  const int o = isa_override().load();
  if (o >= 0) return std::min(o, best_isa());
  static const int from_env = [] {
    const char* e = std::getenv("POSENC_FAST_CPU_ISA");
    return e ? isa_from_name(e) : -1;
  }();
  return from_env >= 0 ? std::min(from_env, best_isa()) : best_isa();
}

inline std::string isa() { return isa_names()[isa_level()]; }
inline std::string best_isa_name() { return isa_names()[best_isa()]; }

inline void set_isa(const std::string& name) {
  if (name.empty() || name == "auto") {
    isa_override().store(-1);
    return;
  }
  const int i = isa_from_name(name);
  TORCH_CHECK_VALUE(i >= 0, "cpu isa must be one of 'auto', 'generic', 'avx2', 'avx512'; got '", name, "'");
  isa_override().store(i);
}

}  // namespace cpu
}  // namespace posenc_fast
