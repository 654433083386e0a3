// Registration of the low-level rotary ops in the posenc_fast namespace, their argument
// checks and their CPU and Meta implementations. The autograd-carrying ops are the Python
// custom ops posenc_fast::lff_rotary / apply_lff_rotary; their "cpp" backend calls:
//
//   lff_rotary_kernel(x [..., M], wr [F/2, M], out_dtype) -> [2, ..., F] (cos, sin planes)
//   lff_rotary_kernel_backward(grad [2, ..., F], x, wr, need_x, need_wr) -> (dx, dwr)
//   apply_lff_rotary_kernel(q, k, x [B, N, M] or [N, M], wr, layout) -> (q', k') in q's dtype
//   apply_lff_rotary_kernel_backward(gq, gk, q, k, x, wr, layout, needs[4]) -> [dq, dk, dx, dwr]
//
// (empty tensors where a gradient is not needed). The apply ops' Meta kernels check q's,
// k's and the gradients' dtypes and devices (no shapes: no ATen call on fake tensors), so a
// call that mixes CPU and Meta tensors, which dispatches to Meta, is refused too.
//
// Each op in turn: its schema, its CPU kernel, its Meta kernel (shapes only, so that
// torch.compile and opcheck can trace it) and their registration (cpu/ops.h: define).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/ops.h"
#include "rotary/rotary_cpu.h"

namespace posenc_fast {
namespace rotary {
namespace {

using cpu::check_float;

// rows [R, M] of x [..., M] and F2 = wr.size(0), checked.
int64_t check_x_wr(const char* op, const at::Tensor& x, const at::Tensor& wr) {
  check_float(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must have shape [..., M] with M >= 1, got ", x.sizes());
  return cpu::check_wr(op, x, wr);
}

// [2, *x.shape[:-1], 2 * F2]. (Element by element: GCC 12 at -O3 reports the range insert of
// x.sizes() into a one-element vector as a memmove out of bounds, a false positive that
// the aarch64 compile check, -Werror, would fail on.)
std::vector<int64_t> table_shape(const at::Tensor& x, int64_t F2) {
  std::vector<int64_t> shape;
  shape.reserve(x.dim() + 1);
  shape.push_back(2);
  for (int64_t d = 0; d + 1 < x.dim(); ++d) shape.push_back(x.size(d));
  shape.push_back(2 * F2);
  return shape;
}

constexpr char kTableSchema[] = "lff_rotary_kernel(Tensor x, Tensor wr, ScalarType out_dtype) -> Tensor";
at::Tensor table_cpu(const at::Tensor& x, const at::Tensor& wr, at::ScalarType out_dtype) {
  const char* op = "lff_rotary_kernel";
  const int64_t F2 = check_x_wr(op, x, wr);
  cpu::check_out_dtype(op, out_dtype);
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  at::Tensor out = at::empty({2, rows.size(0), 2 * F2}, x.options().dtype(out_dtype));
  table_forward_cpu(rows, wr, out);
  return out.view(table_shape(x, F2));
}

at::Tensor table_meta(const at::Tensor& x, const at::Tensor& wr, at::ScalarType out_dtype) {
  return at::empty(table_shape(x, wr.size(0)), x.options().dtype(out_dtype));
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) { cpu::define(m, kTableSchema, &table_cpu, &table_meta); }

constexpr char kTableBackwardSchema[] =
    "lff_rotary_kernel_backward(Tensor grad, Tensor x, Tensor wr, bool need_x, bool need_wr) -> (Tensor, Tensor)";
std::tuple<at::Tensor, at::Tensor> table_backward_cpu_op(const at::Tensor& grad, const at::Tensor& x,
                                                         const at::Tensor& wr, bool need_x, bool need_wr) {
  const char* op = "lff_rotary_kernel_backward";
  const int64_t F2 = check_x_wr(op, x, wr);
  check_float(op, "grad", grad);
  const std::vector<int64_t> shape = table_shape(x, F2);
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(shape), op, ": grad must have the table's shape ",
                    c10::IntArrayRef(shape), ", got ", grad.sizes());
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  at::Tensor dx = need_x ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor dwr = need_wr ? at::empty(wr.sizes(), wr.options()) : at::Tensor();
  at::Tensor dx_rows = need_x ? dx.view({-1, x.size(-1)}) : at::Tensor();
  if (need_x || need_wr) table_backward_cpu(grad.reshape({2, rows.size(0), 2 * F2}), rows, wr, dx_rows, dwr);
  const std::vector<at::Tensor> res = cpu::or_empty({dx, dwr}, grad.options());
  return {res[0], res[1]};
}

std::tuple<at::Tensor, at::Tensor> table_backward_meta(const at::Tensor& grad, const at::Tensor& x,
                                                       const at::Tensor& wr, bool need_x, bool need_wr) {
  const std::vector<at::Tensor> res = cpu::or_empty(
      {need_x ? at::empty(x.sizes(), x.options()) : at::Tensor(), need_wr ? at::empty(wr.sizes(), wr.options()) : at::Tensor()},
      grad.options());
  return {res[0], res[1]};
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) {
  cpu::define(m, kTableBackwardSchema, &table_backward_cpu_op, &table_backward_meta);
}

bool parse_layout(const char* op, c10::string_view layout) {  // true: "bnhd"
  TORCH_CHECK_VALUE(layout == "bhnd" || layout == "bnhd", op, ": layout must be 'bhnd' or 'bnhd'; got '",
                    std::string(layout), "'");
  return layout == "bnhd";
}

// q / k (or their gradients) [B, heads, N, D] in the given layout, as heads-first views.
at::Tensor heads_first(const at::Tensor& t, bool bnhd) { return bnhd ? t.transpose(1, 2) : t; }

// q and k, and the gradients gq and gk (when given): float, on q's device, of q's dtype.
void check_apply_dtypes(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor* gq = nullptr,
                        const at::Tensor* gk = nullptr) {
  check_float(op, "q", q);
  check_float(op, "k", k, "q", q);
  if (gq) check_float(op, "gq", *gq, "q", q);
  if (gk) check_float(op, "gk", *gk, "q", q);
}

// The apply op's arguments, checked, as the kernels take them (x as [Bx, N, M]).
Apply check_apply(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& x,
                  const at::Tensor& wr, bool bnhd) {
  const char* spec = bnhd ? "[B, N, heads, head_dim]" : "[B, heads, N, head_dim]";
  check_apply_dtypes(op, q, k);
  TORCH_CHECK_VALUE(q.dim() == 4, op, ": q must have shape ", spec, ", got ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, op, ": k must have shape ", spec, ", got ", k.sizes());
  const at::Tensor qh = heads_first(q, bnhd), kh = heads_first(k, bnhd);
  const int64_t B = qh.size(0), N = qh.size(2), D = qh.size(3);
  TORCH_CHECK_VALUE(kh.size(0) == B && kh.size(2) == N && kh.size(3) == D, op,
                    ": k must have the batch size, positions and head_dim of q: q ", q.sizes(), ", k ", k.sizes());
  const int64_t F2 = check_x_wr(op, x, wr);
  TORCH_CHECK(x.device() == q.device(), op, ": x must be on q's device (", q.device(), "), got ", x.device());
  TORCH_CHECK_VALUE((x.dim() == 3 && x.size(0) == B && x.size(1) == N) || (x.dim() == 2 && x.size(0) == N), op,
                    ": x must have shape [B, N, M] or [N, M] with B = ", B, " and N = ", N, ", got ", x.sizes());
  TORCH_CHECK_VALUE(2 * F2 <= D, op, ": wr rotates F = 2 * wr.shape[0] = ", 2 * F2, " channels, more than head_dim = ",
                    D);
  return Apply{x.dim() == 3 ? x : x.unsqueeze(0), wr, qh, kh};
}

// The backward's extra arguments, checked; needs (q, k, x, wr).
std::array<bool, 4> check_apply_grads(const char* op, const at::Tensor& gq, const at::Tensor& gk,
                                      const at::Tensor& q, const at::Tensor& k, const c10::List<bool>& needs) {
  check_apply_dtypes(op, q, k, &gq, &gk);
  TORCH_CHECK_VALUE(gq.sizes() == q.sizes(), op, ": gq must have q's shape ", q.sizes(), ", got ", gq.sizes());
  TORCH_CHECK_VALUE(gk.sizes() == k.sizes(), op, ": gk must have k's shape ", k.sizes(), ", got ", gk.sizes());
  TORCH_CHECK_VALUE(needs.size() == 4, op, ": needs must have 4 entries (q, k, x, wr), got ", needs.size());
  return {needs.get(0), needs.get(1), needs.get(2), needs.get(3)};
}

constexpr char kApplySchema[] =
    "apply_lff_rotary_kernel(Tensor q, Tensor k, Tensor x, Tensor wr, str layout) -> (Tensor, Tensor)";
std::tuple<at::Tensor, at::Tensor> apply_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& x,
                                             const at::Tensor& wr, c10::string_view layout) {
  const char* op = "apply_lff_rotary_kernel";
  const bool bnhd = parse_layout(op, layout);
  const Apply in = check_apply(op, q, k, x, wr, bnhd);
  at::Tensor oq = at::empty(q.sizes(), q.options()), ok = at::empty(k.sizes(), q.options());
  at::Tensor oqh = heads_first(oq, bnhd), okh = heads_first(ok, bnhd);
  apply_forward_cpu(in, oqh, okh);
  return {oq, ok};
}

std::tuple<at::Tensor, at::Tensor> apply_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& x,
                                              const at::Tensor& wr, c10::string_view layout) {
  check_apply_dtypes("apply_lff_rotary_kernel", q, k);
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), q.options())};
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) { cpu::define(m, kApplySchema, &apply_cpu, &apply_meta); }

constexpr char kApplyBackwardSchema[] =
    "apply_lff_rotary_kernel_backward(Tensor gq, Tensor gk, Tensor q, Tensor k, Tensor x, Tensor wr, str layout, "
    "bool[] needs) -> Tensor[]";
std::vector<at::Tensor> apply_backward_cpu_op(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& x, const at::Tensor& wr,
                                              c10::string_view layout, const c10::List<bool>& needs_list) {
  const char* op = "apply_lff_rotary_kernel_backward";
  const bool bnhd = parse_layout(op, layout);
  const Apply in = check_apply(op, q, k, x, wr, bnhd);
  const std::array<bool, 4> needs = check_apply_grads(op, gq, gk, q, k, needs_list);
  const at::Tensor* refs[4] = {&q, &k, &x, &wr};
  std::vector<at::Tensor> res(4);
  for (int i = 0; i < 4; ++i)
    if (needs[i]) res[i] = at::empty(refs[i]->sizes(), refs[i]->options());
  ApplyGrads g{needs[0] ? heads_first(res[0], bnhd) : at::Tensor(), needs[1] ? heads_first(res[1], bnhd) : at::Tensor(),
               needs[2] ? res[2].view(in.x3.sizes()) : at::Tensor(), res[3]};
  if (needs[0] || needs[1] || needs[2] || needs[3])
    apply_backward_cpu(heads_first(gq, bnhd), heads_first(gk, bnhd), in, g);
  return cpu::or_empty(std::move(res), gq.options());
}

std::vector<at::Tensor> apply_backward_meta(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& x, const at::Tensor& wr,
                                            c10::string_view layout, const c10::List<bool>& needs) {
  check_apply_dtypes("apply_lff_rotary_kernel_backward", q, k, &gq, &gk);
  const at::Tensor* refs[4] = {&q, &k, &x, &wr};
  std::vector<at::Tensor> res(4);
  for (size_t i = 0; i < 4; ++i)
    if (i < needs.size() && needs.get(i)) res[i] = at::empty(refs[i]->sizes(), refs[i]->options());
  return cpu::or_empty(std::move(res), gq.options());
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) {
  cpu::define(m, kApplyBackwardSchema, &apply_backward_cpu_op, &apply_backward_meta);
}

}  // namespace
}  // namespace rotary
}  // namespace posenc_fast
