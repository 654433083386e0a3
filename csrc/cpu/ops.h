// What the op layers (<op>/<op>_ops.cpp) share: the registration of an op's CPU and Meta
// kernels, and the argument checks and results of the float32 ops (lff, encodings, rotary).
// The Python layer validates first with friendlier messages; these checks keep direct calls
// from reading out of bounds (TORCH_CHECK_VALUE -> ValueError, _TYPE -> TypeError).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <vector>

namespace posenc_fast {
namespace cpu {

// Defines the op of `schema` ("name(args) -> result") in the posenc_fast library and
// registers its CPU and Meta (shapes only) kernels. Called from TORCH_LIBRARY_FRAGMENT
// blocks: the op folders and the Python custom ops each define some of the namespace's ops.
template <typename Cpu, typename Meta>
void define(torch::Library& m, const char* schema, Cpu* cpu, Meta* meta) {
  m.def(schema);
  const std::string name(schema, std::strchr(schema, '(') - schema);
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CPU, cpu));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::Meta, meta));
}

inline bool is_half_or_single(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// t is a float32 / bfloat16 / float16 tensor on the CPU (or Meta: shapes only).
inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " must be a tensor");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_meta(), op, ": ", name, " must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK_TYPE(is_half_or_single(t.scalar_type()), op, ": ", name,
                   " must be float32, bfloat16 or float16, got ", t.scalar_type());
}
// ... and on the device of ref (named ref_name), with its dtype too when same_dtype.
inline void check_float(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                        const at::Tensor& ref, bool same_dtype = true) {
  check_float(op, name, t);
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref_name, "'s device (", ref.device(),
              "), got ", t.device());
  TORCH_CHECK_TYPE(!same_dtype || t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have ", ref_name,
                   "'s dtype (", ref.scalar_type(), "), got ", t.scalar_type());
}

inline void check_out_dtype(const char* op, at::ScalarType t) {
  TORCH_CHECK_TYPE(is_half_or_single(t), op, ": out_dtype must be float32, bfloat16 or float16, got ", t);
}

// wr [F/2, M] against positions x [..., M] (LFF and rotary); returns F/2.
inline int64_t check_wr(const char* op, const at::Tensor& x, const at::Tensor& wr) {
  check_float(op, "wr", wr, "x", x, false);
  TORCH_CHECK_VALUE(wr.dim() == 2 && wr.size(1) == x.size(-1) && wr.size(0) >= 1, op,
                    ": wr must have shape [F/2, M] with F/2 >= 1 and M = x.shape[-1] = ", x.size(-1), ", got ",
                    wr.sizes());
  return wr.size(0);
}

// A backward op's results: where a gradient is not needed (undefined), an empty tensor
// (the schemas return Tensor[] / tuples of tensors, never None).
inline std::vector<at::Tensor> or_empty(std::vector<at::Tensor> res, const at::TensorOptions& options) {
  for (at::Tensor& t : res)
    if (!t.defined()) t = at::empty({0}, options);
  return res;
}

}  // namespace cpu
}  // namespace posenc_fast
