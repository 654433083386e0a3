// Registration of the low-level rotary ops in the posenc_fast namespace, their argument
// checks and their CPU and Meta implementations. The autograd-carrying ops are the Python
// custom ops (posenc_fast/ops/rotary/op.py); their "cpp" backend calls:
//
//   rotary_kernel(q, k, x, freqs, pairs, layout, prefix) -> (q', k') in q's dtype
//   rotary_kernel_backward(gq, gk, q, k, x, freqs, pairs, layout, prefix, needs[4])
//       -> [dq, dk, dx, dfreqs]
//   rotary_table_kernel(x [..., M], freqs, pairs, out_dtype) -> [2, ..., F] (cos, sin planes)
//   rotary_table_kernel_backward(grad, x, freqs, pairs, need_x, need_freqs) -> (dx, dfreqs)
//
// q, k [B, H, N, D] ("bhnd") or [B, N, H, D] ("bnhd"); x [N - prefix, M] or
// [B, N - prefix, M]; freqs [F/2, M] shared by the heads (k may have fewer heads than q) or
// [H, F/2, M] one per head; pairs "interleaved" (2i, 2i+1) or "half" (i, i + F/2). The
// table is [2, *x.shape[:-1], F] for shared freqs, [2, *x.shape[:-2], H, N, F] per head.
// (Empty tensors where a gradient is not needed.) The apply ops' Meta kernels check q's,
// k's and the gradients' dtypes and devices (no shapes: no ATen call on fake tensors), so a
// call that mixes CPU and Meta tensors, which dispatches to Meta, is refused too.
//
// Each op in turn: schema, CPU kernel, Meta kernel (shapes only), registration (cpu/ops.h).
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

bool parse_pairs(const char* op, c10::string_view pairs) {  // true: "half"
  TORCH_CHECK_VALUE(pairs == "interleaved" || pairs == "half", op,
                    ": pairs must be 'interleaved' or 'half'; got '", std::string(pairs), "'");
  return pairs == "half";
}

// freqs [F/2, M] or [H, F/2, M] against positions x [..., M]: float, on x's device; returns
// it as [G, F/2, M] (G = 1 for shared frequencies, a view).
at::Tensor check_freqs(const char* op, const at::Tensor& x, const at::Tensor& freqs) {
  check_float(op, "freqs", freqs, "x", x, false);
  TORCH_CHECK_VALUE((freqs.dim() == 2 || freqs.dim() == 3) && freqs.size(-1) == x.size(-1) && freqs.size(-2) >= 1,
                    op, ": freqs must have shape [F/2, M] or [heads, F/2, M] with F/2 >= 1 and M = x.shape[-1] = ",
                    x.size(-1), ", got ", freqs.sizes());
  return freqs.dim() == 2 ? freqs.unsqueeze(0) : freqs;
}

// x [..., M] with M >= 1 (at least [N, M] for frequencies per head), float.
void check_x(const char* op, const at::Tensor& x, bool per_head) {
  check_float(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= (per_head ? 2 : 1) && x.size(-1) >= 1, op, ": x must have shape ",
                    per_head ? "[..., N, M]" : "[..., M]", " with M >= 1, got ", x.sizes());
}

// The table's shape: [2, *x.shape[:-1], F] (shared), [2, *x.shape[:-2], H, N, F] (per head).
// (Element by element: GCC 12 -O3 reports the range insert of x.sizes() as a memmove out
// of bounds, a false positive that the aarch64 compile check, -Werror, would fail on.)
std::vector<int64_t> table_shape(const at::Tensor& x, const at::Tensor& freqs) {
  const bool per_head = freqs.dim() == 3;
  std::vector<int64_t> shape;
  shape.reserve(x.dim() + 2);
  shape.push_back(2);
  for (int64_t d = 0; d + (per_head ? 2 : 1) < x.dim(); ++d) shape.push_back(x.size(d));
  if (per_head) {
    shape.push_back(freqs.size(0));
    shape.push_back(x.size(-2));
  }
  shape.push_back(2 * freqs.size(-2));
  return shape;
}

// x as the kernels' rows [Bx, N, M]: [1, R, M] for shared frequencies, [prod, N, M] per head.
at::Tensor table_rows(const at::Tensor& x, bool per_head) {
  const int64_t M = x.size(-1);
  return per_head ? x.reshape({-1, x.size(-2), M}) : x.reshape({1, -1, M});
}

constexpr char kTableSchema[] =
    "rotary_table_kernel(Tensor x, Tensor freqs, str pairs, ScalarType out_dtype) -> Tensor";
at::Tensor table_cpu(const at::Tensor& x, const at::Tensor& freqs, c10::string_view pairs,
                     at::ScalarType out_dtype) {
  const char* op = "rotary_table_kernel";
  const bool half = parse_pairs(op, pairs);
  check_x(op, x, freqs.dim() == 3);
  const at::Tensor w = check_freqs(op, x, freqs);
  cpu::check_out_dtype(op, out_dtype);
  const at::Tensor x3 = table_rows(x, freqs.dim() == 3);
  at::Tensor out = at::empty({2, x3.size(0), w.size(0), x3.size(1), 2 * w.size(1)}, x.options().dtype(out_dtype));
  table_forward_cpu(x3, w, half, out);
  return out.view(table_shape(x, freqs));
}

at::Tensor table_meta(const at::Tensor& x, const at::Tensor& freqs, c10::string_view pairs,
                      at::ScalarType out_dtype) {
  return at::empty(table_shape(x, freqs), x.options().dtype(out_dtype));
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) { cpu::define(m, kTableSchema, &table_cpu, &table_meta); }

constexpr char kTableBackwardSchema[] =
    "rotary_table_kernel_backward(Tensor grad, Tensor x, Tensor freqs, str pairs, bool need_x, bool need_freqs) "
    "-> (Tensor, Tensor)";
std::tuple<at::Tensor, at::Tensor> table_backward_cpu_op(const at::Tensor& grad, const at::Tensor& x,
                                                         const at::Tensor& freqs, c10::string_view pairs,
                                                         bool need_x, bool need_freqs) {
  const char* op = "rotary_table_kernel_backward";
  const bool half = parse_pairs(op, pairs);
  const bool per_head = freqs.dim() == 3;
  check_x(op, x, per_head);
  const at::Tensor w = check_freqs(op, x, freqs);
  check_float(op, "grad", grad);
  const std::vector<int64_t> shape = table_shape(x, freqs);
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(shape), op, ": grad must have the table's shape ",
                    c10::IntArrayRef(shape), ", got ", grad.sizes());
  const at::Tensor x3 = table_rows(x, per_head);
  at::Tensor dx = need_x ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor dw = need_freqs ? at::empty(freqs.sizes(), freqs.options()) : at::Tensor();
  at::Tensor dx3 = need_x ? dx.view(x3.sizes()) : at::Tensor();
  at::Tensor dw3 = need_freqs ? dw.view(w.sizes()) : at::Tensor();
  if (need_x || need_freqs) {
    const at::Tensor g = grad.reshape({2, x3.size(0), w.size(0), x3.size(1), 2 * w.size(1)});
    table_backward_cpu(g, x3, w, half, dx3, dw3);
  }
  const std::vector<at::Tensor> res = cpu::or_empty({dx, dw}, grad.options());
  return {res[0], res[1]};
}

std::tuple<at::Tensor, at::Tensor> table_backward_meta(const at::Tensor& grad, const at::Tensor& x,
                                                       const at::Tensor& freqs, c10::string_view pairs, bool need_x,
                                                       bool need_freqs) {
  const std::vector<at::Tensor> res =
      cpu::or_empty({need_x ? at::empty(x.sizes(), x.options()) : at::Tensor(),
                     need_freqs ? at::empty(freqs.sizes(), freqs.options()) : at::Tensor()},
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

// The apply op's arguments, checked, as the kernels take them (x as [Bx, N', M], freqs as
// [G, F/2, M]).
Apply check_apply(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& x,
                  const at::Tensor& freqs, c10::string_view pairs, bool bnhd, int64_t prefix) {
  const char* spec = bnhd ? "[B, N, heads, head_dim]" : "[B, heads, N, head_dim]";
  const bool half = parse_pairs(op, pairs);
  check_apply_dtypes(op, q, k);
  TORCH_CHECK_VALUE(q.dim() == 4, op, ": q must have shape ", spec, ", got ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, op, ": k must have shape ", spec, ", got ", k.sizes());
  const at::Tensor qh = heads_first(q, bnhd), kh = heads_first(k, bnhd);
  const int64_t B = qh.size(0), N = qh.size(2), D = qh.size(3);
  TORCH_CHECK_VALUE(kh.size(0) == B && kh.size(2) == N && kh.size(3) == D, op,
                    ": k must have the batch size, positions and head_dim of q: q ", q.sizes(), ", k ", k.sizes());
  TORCH_CHECK_VALUE(prefix >= 0 && prefix <= N, op, ": prefix must be in [0, N] with N = ", N, ", got ", prefix);
  check_float(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.size(-1) >= 1, op, ": x must have shape [B, N - prefix, M] or [N - prefix, M]",
                    " with M >= 1, got ", x.sizes());
  const at::Tensor w = check_freqs(op, x, freqs);
  TORCH_CHECK(x.device() == q.device(), op, ": x must be on q's device (", q.device(), "), got ", x.device());
  const int64_t n = N - prefix;
  TORCH_CHECK_VALUE((x.dim() == 3 && x.size(0) == B && x.size(1) == n) || (x.dim() == 2 && x.size(0) == n), op,
                    ": x must have shape [B, N - prefix, M] or [N - prefix, M] with B = ", B, " and N - prefix = ", n,
                    ", got ", x.sizes());
  TORCH_CHECK_VALUE(freqs.dim() == 2 || (freqs.size(0) == qh.size(1) && freqs.size(0) == kh.size(1)), op,
                    ": freqs per head [heads, F/2, M] must have the heads of q and k (", qh.size(1), ", ", kh.size(1),
                    "), got ", freqs.sizes());
  TORCH_CHECK_VALUE(2 * w.size(1) <= D, op, ": freqs rotates F = 2 * freqs.shape[-2] = ", 2 * w.size(1),
                    " channels, more than head_dim = ", D);
  return Apply{x.dim() == 3 ? x : x.unsqueeze(0), w, qh, kh, half, prefix};
}

// The backward's extra arguments, checked; needs (q, k, x, freqs).
std::array<bool, 4> check_apply_grads(const char* op, const at::Tensor& gq, const at::Tensor& gk,
                                      const at::Tensor& q, const at::Tensor& k, const c10::List<bool>& needs) {
  check_apply_dtypes(op, q, k, &gq, &gk);
  TORCH_CHECK_VALUE(gq.sizes() == q.sizes(), op, ": gq must have q's shape ", q.sizes(), ", got ", gq.sizes());
  TORCH_CHECK_VALUE(gk.sizes() == k.sizes(), op, ": gk must have k's shape ", k.sizes(), ", got ", gk.sizes());
  TORCH_CHECK_VALUE(needs.size() == 4, op, ": needs must have 4 entries (q, k, x, freqs), got ", needs.size());
  return {needs.get(0), needs.get(1), needs.get(2), needs.get(3)};
}

constexpr char kApplySchema[] =
    "rotary_kernel(Tensor q, Tensor k, Tensor x, Tensor freqs, str pairs, str layout, int prefix) -> (Tensor, Tensor)";
std::tuple<at::Tensor, at::Tensor> apply_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& x,
                                             const at::Tensor& freqs, c10::string_view pairs, c10::string_view layout,
                                             int64_t prefix) {
  const char* op = "rotary_kernel";
  const bool bnhd = parse_layout(op, layout);
  const Apply in = check_apply(op, q, k, x, freqs, pairs, bnhd, prefix);
  at::Tensor oq = at::empty(q.sizes(), q.options()), ok = at::empty(k.sizes(), q.options());
  at::Tensor oqh = heads_first(oq, bnhd), okh = heads_first(ok, bnhd);
  apply_forward_cpu(in, oqh, okh);
  return {oq, ok};
}

std::tuple<at::Tensor, at::Tensor> apply_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& x,
                                              const at::Tensor& freqs, c10::string_view pairs,
                                              c10::string_view layout, int64_t prefix) {
  check_apply_dtypes("rotary_kernel", q, k);
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), q.options())};
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) { cpu::define(m, kApplySchema, &apply_cpu, &apply_meta); }

constexpr char kApplyBackwardSchema[] =
    "rotary_kernel_backward(Tensor gq, Tensor gk, Tensor q, Tensor k, Tensor x, Tensor freqs, str pairs, str layout, "
    "int prefix, bool[] needs) -> Tensor[]";
std::vector<at::Tensor> apply_backward_cpu_op(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& x, const at::Tensor& freqs,
                                              c10::string_view pairs, c10::string_view layout, int64_t prefix,
                                              const c10::List<bool>& needs_list) {
  const char* op = "rotary_kernel_backward";
  const bool bnhd = parse_layout(op, layout);
  const Apply in = check_apply(op, q, k, x, freqs, pairs, bnhd, prefix);
  const std::array<bool, 4> needs = check_apply_grads(op, gq, gk, q, k, needs_list);
  const at::Tensor* refs[4] = {&q, &k, &x, &freqs};
  std::vector<at::Tensor> res(4);
  for (int i = 0; i < 4; ++i)
    if (needs[i]) res[i] = at::empty(refs[i]->sizes(), refs[i]->options());
  ApplyGrads g{needs[0] ? heads_first(res[0], bnhd) : at::Tensor(), needs[1] ? heads_first(res[1], bnhd) : at::Tensor(),
               needs[2] ? res[2].view(in.x3.sizes()) : at::Tensor(),
               needs[3] ? res[3].view(in.freqs.sizes()) : at::Tensor()};
  if (needs[0] || needs[1] || needs[2] || needs[3])
    apply_backward_cpu(heads_first(gq, bnhd), heads_first(gk, bnhd), in, g);
  return cpu::or_empty(std::move(res), gq.options());
}

std::vector<at::Tensor> apply_backward_meta(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& x, const at::Tensor& freqs,
                                            c10::string_view pairs, c10::string_view layout, int64_t prefix,
                                            const c10::List<bool>& needs) {
  check_apply_dtypes("rotary_kernel_backward", q, k, &gq, &gk);
  const at::Tensor* refs[4] = {&q, &k, &x, &freqs};
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
