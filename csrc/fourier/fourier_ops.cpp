// Registration of the low-level LFF and encoding ops in the posenc_fast namespace, their
// argument checks and their CPU and Meta implementations. The autograd-carrying ops are the
// Python custom ops posenc_fast::lff / encoding / encoding_add (posenc_fast/ops/); their
// "cpp" backend (posenc_fast/backends/extension_backends.py) calls:
//
//   lff_kernel(x [..., G, M], wr [F/2, M], w1? [F, H], b1? [H], w2? [H, Dg], b2? [Dg],
//              activation, out_dtype) -> [..., G * Dg]   ([..., G * F] without w1..b2)
//   lff_kernel_backward(grad, x, wr, w1?, b1?, w2?, b2?, activation, needs[6])
//       -> [dx, dwr, dw1, db1, dw2, db2]   (empty tensors where needs[i] is false)
//   encoding_kernel(positions [...], dim, kind, base, block?, out_dtype) -> [..., dim]
//   encoding_add_kernel(x [..., dim], positions (broadcast to x.shape[:-1]), kind, base, block?)
//       -> x + encoding, in x's dtype
//   encoding_kernel_backward(grad [*positions.shape, dim], positions, dim, kind, base)
//       -> d positions (float32 for integer positions)
//   lff_rotary_kernel(x [..., M], wr [F/2, M], out_dtype) -> [2, ..., F] (cos, sin planes)
//   lff_rotary_kernel_backward(grad [2, ..., F], x, wr, need_x, need_wr) -> (dx, dwr)
//   apply_lff_rotary_kernel(q, k, x [B, N, M] or [N, M], wr, layout) -> (q', k') in q's dtype
//   apply_lff_rotary_kernel_backward(gq, gk, q, k, x, wr, layout, needs[4]) -> [dq, dk, dx, dwr]
//
// The Python layer validates first with friendlier messages; these checks keep direct calls
// from reading out of bounds. TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE -> TypeError.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "fourier_cpu.h"

namespace posenc_fast {
namespace fourier {
namespace {

bool is_half_or_single(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " must be a tensor");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_meta(), op, ": ", name, " must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK_TYPE(is_half_or_single(t.scalar_type()), op, ": ", name,
                   " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

void check_out_dtype(const char* op, at::ScalarType t) {
  TORCH_CHECK_TYPE(is_half_or_single(t), op, ": out_dtype must be float32, bfloat16 or float16, got ", t);
}

LffActivation parse_activation(const char* op, c10::string_view a) {
  if (a == "gelu") return LffActivation::GELU;
  if (a == "gelu_tanh") return LffActivation::GELU_TANH;
  if (a == "relu") return LffActivation::RELU;
  TORCH_CHECK_VALUE(false, op, ": activation must be one of 'gelu', 'gelu_tanh', 'relu'; got '", std::string(a),
                    "'");
}

// wr [F/2, M] against positions x [..., M] (LFF and rotary); returns F/2.
int64_t check_wr(const char* op, const at::Tensor& x, const at::Tensor& wr) {
  check_float(op, "wr", wr);
  TORCH_CHECK_VALUE(wr.dim() == 2 && wr.size(1) == x.size(-1) && wr.size(0) >= 1, op,
                    ": wr must have shape [F/2, M] with F/2 >= 1 and M = x.shape[-1] = ", x.size(-1), ", got ",
                    wr.sizes());
  TORCH_CHECK(wr.device() == x.device(), op, ": wr must be on x's device");
  return wr.size(0);
}

EncodingKind parse_kind(const char* op, c10::string_view k) {
  if (k == "sinusoidal") return EncodingKind::Sinusoidal;
  if (k == "dft") return EncodingKind::DFT;
  TORCH_CHECK_VALUE(false, op, ": kind must be 'sinusoidal' or 'dft'; got '", std::string(k), "'");
}

// The LFF arguments, checked; width of a group's output (Dg, or F without the MLP).
struct Lff {
  at::Tensor w1, b1, w2, b2;  // undefined without the MLP
  int64_t M, F2, H, width;
};

Lff check_lff(const char* op, const at::Tensor& x, const at::Tensor& wr, const c10::optional<at::Tensor>& w1,
              const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
              const c10::optional<at::Tensor>& b2) {
  check_float(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.size(-1) >= 1, op, ": x must have shape [..., G, M] with M >= 1, got ",
                    x.sizes());
  Lff l{};
  l.M = x.size(-1);
  l.F2 = check_wr(op, x, wr);
  const int given = w1.has_value() + b1.has_value() + w2.has_value() + b2.has_value();
  TORCH_CHECK_VALUE(given == 0 || given == 4, op, ": w1, b1, w2 and b2 must be given together");
  if (given == 0) {
    l.width = 2 * l.F2;
    return l;
  }
  l.w1 = *w1, l.b1 = *b1, l.w2 = *w2, l.b2 = *b2;
  const char* names[4] = {"w1", "b1", "w2", "b2"};
  const at::Tensor* ts[4] = {&l.w1, &l.b1, &l.w2, &l.b2};
  for (int i = 0; i < 4; ++i) {
    check_float(op, names[i], *ts[i]);
    TORCH_CHECK_TYPE(ts[i]->scalar_type() == wr.scalar_type(), op, ": ", names[i], " must have wr's dtype (",
                     wr.scalar_type(), "), got ", ts[i]->scalar_type());
    TORCH_CHECK(ts[i]->device() == x.device(), op, ": ", names[i], " must be on x's device");
  }
  TORCH_CHECK_VALUE(l.w1.dim() == 2 && l.w1.size(0) == 2 * l.F2, op, ": w1 must have shape [F, H] with F = ",
                    2 * l.F2, ", got ", l.w1.sizes());
  l.H = l.w1.size(1);
  TORCH_CHECK_VALUE(l.b1.dim() == 1 && l.b1.size(0) == l.H, op, ": b1 must have shape [H] = [", l.H, "], got ",
                    l.b1.sizes());
  TORCH_CHECK_VALUE(l.w2.dim() == 2 && l.w2.size(0) == l.H, op, ": w2 must have shape [H, Dg] with H = ", l.H,
                    ", got ", l.w2.sizes());
  l.width = l.w2.size(1);
  TORCH_CHECK_VALUE(l.b2.dim() == 1 && l.b2.size(0) == l.width, op, ": b2 must have shape [Dg] = [", l.width,
                    "], got ", l.b2.sizes());
  return l;
}

std::vector<int64_t> lff_out_shape(const at::Tensor& x, int64_t width) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 2);
  shape.push_back(x.size(-2) * width);
  return shape;
}

at::Tensor lff_cpu(const at::Tensor& x, const at::Tensor& wr, const c10::optional<at::Tensor>& w1,
                   const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
                   const c10::optional<at::Tensor>& b2, c10::string_view activation, at::ScalarType out_dtype) {
  const Lff l = check_lff("lff_kernel", x, wr, w1, b1, w2, b2);
  const LffActivation act = parse_activation("lff_kernel", activation);
  check_out_dtype("lff_kernel", out_dtype);
  // Never written: the kernels read x through a [R, M] view (or copy) and write a new output.
  const at::Tensor rows = x.reshape({-1, l.M});
  return cpu::lff_forward(rows, wr, l.w1, l.b1, l.w2, l.b2, act, out_dtype).view(lff_out_shape(x, l.width));
}

std::vector<at::Tensor> lff_backward_cpu(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& wr,
                                         const c10::optional<at::Tensor>& w1, const c10::optional<at::Tensor>& b1,
                                         const c10::optional<at::Tensor>& w2, const c10::optional<at::Tensor>& b2,
                                         c10::string_view activation, const c10::List<bool>& needs_list) {
  const char* op = "lff_kernel_backward";
  const Lff l = check_lff(op, x, wr, w1, b1, w2, b2);
  const LffActivation act = parse_activation(op, activation);
  check_float(op, "grad", grad);
  const std::vector<int64_t> shape = lff_out_shape(x, l.width);
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(shape), op, ": grad must have the output's shape ",
                    c10::IntArrayRef(shape), ", got ", grad.sizes());
  TORCH_CHECK_VALUE(needs_list.size() == 6, op, ": needs must have 6 entries (x, wr, w1, b1, w2, b2), got ",
                    needs_list.size());
  std::array<bool, 6> needs{};
  for (size_t i = 0; i < 6; ++i) needs[i] = needs_list.get(i);
  const at::Tensor rows = x.reshape({-1, l.M});
  at::Tensor g = grad.reshape({rows.size(0), l.width});
  if (l.width > 1 && g.stride(1) != 1) g = g.contiguous();
  std::vector<at::Tensor> res = cpu::lff_backward(g, rows, wr, l.w1, l.b1, l.w2, l.b2, act, needs);
  if (res[0].defined()) res[0] = res[0].view(x.sizes());
  for (auto& t : res)
    if (!t.defined()) t = at::empty({0}, grad.options());
  return res;
}

// Encodings ----------------------------------------------------------------------------

void check_positions(const char* op, const at::Tensor& p) {
  TORCH_CHECK_VALUE(p.defined(), op, ": positions must be a tensor");
  const at::ScalarType t = p.scalar_type();
  const bool ok = is_half_or_single(t) || t == at::kByte || t == at::kChar || t == at::kShort || t == at::kInt ||
                  t == at::kLong;
  TORCH_CHECK_TYPE(ok, op, ": positions must be float32, bfloat16, float16 or an integer dtype, got ", t);
}

void check_encoding(const char* op, int64_t dim, EncodingKind kind, double base, c10::optional<double> block) {
  TORCH_CHECK_VALUE(dim > 0 && dim % 2 == 0, op, ": dim must be a positive even number, got ", dim);
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 0.0, op, ": base must be a finite positive number, got ", base);
  TORCH_CHECK_VALUE(!block || std::isfinite(*block), op, ": block must be finite, got ", block ? *block : 0.0);
}

at::Tensor encoding_cpu(const at::Tensor& positions, int64_t dim, c10::string_view kind, double base,
                        c10::optional<double> block, at::ScalarType out_dtype) {
  const char* op = "encoding_kernel";
  check_positions(op, positions);
  const EncodingKind k = parse_kind(op, kind);
  check_encoding(op, dim, k, base, block);
  check_out_dtype(op, out_dtype);
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(dim);
  return cpu::encoding_forward(positions.reshape({-1}), 0, at::Tensor(), dim, k, base, block, out_dtype).view(shape);
}

at::Tensor encoding_add_cpu(const at::Tensor& x, const at::Tensor& positions, c10::string_view kind, double base,
                            c10::optional<double> block) {
  const char* op = "encoding_add_kernel";
  check_float(op, "x", x);
  check_positions(op, positions);
  const EncodingKind k = parse_kind(op, kind);
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have shape [..., dim], got a scalar");
  const int64_t dim = x.size(-1);
  check_encoding(op, dim, k, base, block);
  const c10::IntArrayRef lead = x.sizes().slice(0, x.dim() - 1);
  bool broadcasts = positions.dim() <= static_cast<int64_t>(lead.size());
  for (int64_t i = 1; broadcasts && i <= positions.dim(); ++i) {
    const int64_t s = positions.size(-i);
    broadcasts = s == 1 || s == lead[lead.size() - i];
  }
  TORCH_CHECK_VALUE(broadcasts, op, ": positions must broadcast to x.shape[:-1] = ", lead, ", got ",
                    positions.sizes());
  // positions [L] against [..., L]: each position is encoded once for all its rows.
  at::Tensor p;
  int64_t period = 0;
  if (positions.dim() == 1 && !lead.empty() && positions.size(0) == lead.back() && positions.size(0) > 0) {
    p = positions;
    period = positions.size(0);
  } else {
    p = positions.expand(lead).reshape({-1});
  }
  at::Tensor rows = x.reshape({-1, dim});
  if (dim > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  return cpu::encoding_forward(p, period, rows, dim, k, base, block, x.scalar_type()).view(x.sizes());
}

at::Tensor encoding_backward_cpu(const at::Tensor& grad, const at::Tensor& positions, int64_t dim,
                                 c10::string_view kind, double base) {
  const char* op = "encoding_kernel_backward";
  check_positions(op, positions);
  check_float(op, "grad", grad);
  const EncodingKind k = parse_kind(op, kind);
  check_encoding(op, dim, k, base, c10::nullopt);
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(dim);
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(shape), op, ": grad must have shape [*positions.shape, dim] = ",
                    c10::IntArrayRef(shape), ", got ", grad.sizes());
  at::Tensor g = grad.reshape({-1, dim});
  if (dim > 1 && g.stride(1) != 1) g = g.contiguous();
  return cpu::encoding_backward(g, positions.reshape({-1}), dim, k, base).view(positions.sizes());
}

// Rotary embeddings --------------------------------------------------------------------

// rows [R, M] of x [..., M] and F2 = wr.size(0), checked.
int64_t check_rotary_wr(const char* op, const at::Tensor& x, const at::Tensor& wr) {
  check_float(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must have shape [..., M] with M >= 1, got ", x.sizes());
  return check_wr(op, x, wr);
}

std::vector<int64_t> table_shape(const at::Tensor& x, int64_t F2) {
  std::vector<int64_t> shape{2};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(2 * F2);
  return shape;
}

at::Tensor rotary_table_cpu(const at::Tensor& x, const at::Tensor& wr, at::ScalarType out_dtype) {
  const char* op = "lff_rotary_kernel";
  const int64_t F2 = check_rotary_wr(op, x, wr);
  check_out_dtype(op, out_dtype);
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  at::Tensor out = at::empty({2, rows.size(0), 2 * F2}, x.options().dtype(out_dtype));
  cpu::rotary_table_forward(rows, wr, out);
  return out.view(table_shape(x, F2));
}

std::tuple<at::Tensor, at::Tensor> rotary_table_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                                             const at::Tensor& wr, bool need_x, bool need_wr) {
  const char* op = "lff_rotary_kernel_backward";
  const int64_t F2 = check_rotary_wr(op, x, wr);
  check_float(op, "grad", grad);
  const std::vector<int64_t> shape = table_shape(x, F2);
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(shape), op, ": grad must have the table's shape ",
                    c10::IntArrayRef(shape), ", got ", grad.sizes());
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  at::Tensor dx = need_x ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor dwr = need_wr ? at::empty(wr.sizes(), wr.options()) : at::Tensor();
  at::Tensor dx_rows = need_x ? dx.view({-1, x.size(-1)}) : at::Tensor();
  if (need_x || need_wr) cpu::rotary_table_backward(grad.reshape({2, rows.size(0), 2 * F2}), rows, wr, dx_rows, dwr);
  return {need_x ? dx : at::empty({0}, grad.options()), need_wr ? dwr : at::empty({0}, grad.options())};
}

bool parse_layout(const char* op, c10::string_view layout) {  // true: "bnhd"
  TORCH_CHECK_VALUE(layout == "bhnd" || layout == "bnhd", op, ": layout must be 'bhnd' or 'bnhd'; got '",
                    std::string(layout), "'");
  return layout == "bnhd";
}

// q / k (or their gradients) [B, heads, N, D] in the given layout, as heads-first views.
at::Tensor heads_first(const at::Tensor& t, bool bnhd) { return bnhd ? t.transpose(1, 2) : t; }

// The apply op's arguments, checked; x as [Bx, N, M].
at::Tensor check_apply(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& x,
                       const at::Tensor& wr, bool bnhd) {
  const char* spec = bnhd ? "[B, N, heads, head_dim]" : "[B, heads, N, head_dim]";
  check_float(op, "q", q);
  check_float(op, "k", k);
  TORCH_CHECK_VALUE(q.dim() == 4, op, ": q must have shape ", spec, ", got ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, op, ": k must have shape ", spec, ", got ", k.sizes());
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), op, ": k must have q's dtype (", q.scalar_type(), "), got ",
                   k.scalar_type());
  const at::Tensor qh = heads_first(q, bnhd), kh = heads_first(k, bnhd);
  const int64_t B = qh.size(0), N = qh.size(2), D = qh.size(3);
  TORCH_CHECK_VALUE(kh.size(0) == B && kh.size(2) == N && kh.size(3) == D, op,
                    ": k must have the batch size, positions and head_dim of q: q ", q.sizes(), ", k ", k.sizes());
  const int64_t F2 = check_rotary_wr(op, x, wr);
  TORCH_CHECK_VALUE((x.dim() == 3 && x.size(0) == B && x.size(1) == N) || (x.dim() == 2 && x.size(0) == N), op,
                    ": x must have shape [B, N, M] or [N, M] with B = ", B, " and N = ", N, ", got ", x.sizes());
  TORCH_CHECK_VALUE(2 * F2 <= D, op, ": wr rotates F = 2 * wr.shape[0] = ", 2 * F2, " channels, more than head_dim = ",
                    D);
  return x.dim() == 3 ? x : x.unsqueeze(0);
}

std::tuple<at::Tensor, at::Tensor> rotary_apply_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& x,
                                                    const at::Tensor& wr, c10::string_view layout) {
  const char* op = "apply_lff_rotary_kernel";
  const bool bnhd = parse_layout(op, layout);
  const at::Tensor x3 = check_apply(op, q, k, x, wr, bnhd);
  at::Tensor oq = at::empty(q.sizes(), q.options()), ok = at::empty(k.sizes(), q.options());
  at::Tensor oqh = heads_first(oq, bnhd), okh = heads_first(ok, bnhd);
  cpu::rotary_apply_forward(x3, wr, heads_first(q, bnhd), heads_first(k, bnhd), oqh, okh);
  return {oq, ok};
}

std::vector<at::Tensor> rotary_apply_backward_cpu(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& q,
                                                  const at::Tensor& k, const at::Tensor& x, const at::Tensor& wr,
                                                  c10::string_view layout, const c10::List<bool>& needs_list) {
  const char* op = "apply_lff_rotary_kernel_backward";
  const bool bnhd = parse_layout(op, layout);
  const at::Tensor x3 = check_apply(op, q, k, x, wr, bnhd);
  check_float(op, "gq", gq);
  check_float(op, "gk", gk);
  TORCH_CHECK_VALUE(gq.sizes() == q.sizes(), op, ": gq must have q's shape ", q.sizes(), ", got ", gq.sizes());
  TORCH_CHECK_VALUE(gk.sizes() == k.sizes(), op, ": gk must have k's shape ", k.sizes(), ", got ", gk.sizes());
  TORCH_CHECK_TYPE(gq.scalar_type() == q.scalar_type() && gk.scalar_type() == q.scalar_type(), op,
                   ": gq and gk must have q's dtype (", q.scalar_type(), "), got ", gq.scalar_type(), " and ",
                   gk.scalar_type());
  TORCH_CHECK_VALUE(needs_list.size() == 4, op, ": needs must have 4 entries (q, k, x, wr), got ", needs_list.size());
  const bool need_q = needs_list.get(0), need_k = needs_list.get(1), need_x = needs_list.get(2),
             need_wr = needs_list.get(3);
  at::Tensor dq = need_q ? at::empty(q.sizes(), q.options()) : at::Tensor();
  at::Tensor dk = need_k ? at::empty(k.sizes(), k.options()) : at::Tensor();
  at::Tensor dx = need_x ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor dwr = need_wr ? at::empty(wr.sizes(), wr.options()) : at::Tensor();
  at::Tensor dqh = need_q ? heads_first(dq, bnhd) : at::Tensor(), dkh = need_k ? heads_first(dk, bnhd) : at::Tensor();
  at::Tensor dx3 = need_x ? dx.view(x3.sizes()) : at::Tensor();
  if (need_q || need_k || need_x || need_wr)
    cpu::rotary_apply_backward(heads_first(gq, bnhd), heads_first(gk, bnhd), heads_first(q, bnhd),
                               heads_first(k, bnhd), x3, wr, dqh, dkh, dx3, dwr);
  std::vector<at::Tensor> res{dq, dk, dx, dwr};
  for (auto& t : res)
    if (!t.defined()) t = at::empty({0}, gq.options());
  return res;
}

// Meta (fake tensor) kernels: shapes only, so torch.compile and opcheck can trace the ops.
at::Tensor lff_meta(const at::Tensor& x, const at::Tensor& wr, const c10::optional<at::Tensor>& w1,
                    const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
                    const c10::optional<at::Tensor>& b2, c10::string_view activation, at::ScalarType out_dtype) {
  const int64_t width = w2.has_value() ? w2->size(1) : 2 * wr.size(0);
  return at::empty(lff_out_shape(x, width), x.options().dtype(out_dtype));
}

std::vector<at::Tensor> lff_backward_meta(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& wr,
                                          const c10::optional<at::Tensor>& w1, const c10::optional<at::Tensor>& b1,
                                          const c10::optional<at::Tensor>& w2, const c10::optional<at::Tensor>& b2,
                                          c10::string_view activation, const c10::List<bool>& needs) {
  const at::Tensor refs[6] = {x, wr, w1.value_or(at::Tensor()), b1.value_or(at::Tensor()),
                              w2.value_or(at::Tensor()), b2.value_or(at::Tensor())};
  std::vector<at::Tensor> res;
  for (size_t i = 0; i < 6; ++i) {
    const bool need = i < needs.size() && needs.get(i) && refs[i].defined();
    res.push_back(need ? at::empty(refs[i].sizes(), refs[i].options()) : at::empty({0}, grad.options()));
  }
  return res;
}

at::Tensor encoding_meta(const at::Tensor& positions, int64_t dim, c10::string_view kind, double base,
                         c10::optional<double> block, at::ScalarType out_dtype) {
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(dim);
  return at::empty(shape, positions.options().dtype(out_dtype));
}

at::Tensor encoding_add_meta(const at::Tensor& x, const at::Tensor& positions, c10::string_view kind, double base,
                             c10::optional<double> block) {
  return at::empty(x.sizes(), x.options());
}

at::Tensor encoding_backward_meta(const at::Tensor& grad, const at::Tensor& positions, int64_t dim,
                                  c10::string_view kind, double base) {
  const at::ScalarType t = at::isFloatingType(positions.scalar_type()) ? positions.scalar_type() : at::kFloat;
  return at::empty(positions.sizes(), positions.options().dtype(t));
}

at::Tensor rotary_table_meta(const at::Tensor& x, const at::Tensor& wr, at::ScalarType out_dtype) {
  return at::empty(table_shape(x, wr.size(0)), x.options().dtype(out_dtype));
}

std::tuple<at::Tensor, at::Tensor> rotary_table_backward_meta(const at::Tensor& grad, const at::Tensor& x,
                                                              const at::Tensor& wr, bool need_x, bool need_wr) {
  return {need_x ? at::empty(x.sizes(), x.options()) : at::empty({0}, grad.options()),
          need_wr ? at::empty(wr.sizes(), wr.options()) : at::empty({0}, grad.options())};
}

std::tuple<at::Tensor, at::Tensor> rotary_apply_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& x,
                                                     const at::Tensor& wr, c10::string_view layout) {
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), q.options())};
}

std::vector<at::Tensor> rotary_apply_backward_meta(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& q,
                                                   const at::Tensor& k, const at::Tensor& x, const at::Tensor& wr,
                                                   c10::string_view layout, const c10::List<bool>& needs) {
  const at::Tensor refs[4] = {q, k, x, wr};
  std::vector<at::Tensor> res;
  for (size_t i = 0; i < 4; ++i) {
    const bool need = i < needs.size() && needs.get(i);
    res.push_back(need ? at::empty(refs[i].sizes(), refs[i].options()) : at::empty({0}, gq.options()));
  }
  return res;
}

}  // namespace
}  // namespace fourier
}  // namespace posenc_fast

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) {
  m.def(
      "lff_kernel(Tensor x, Tensor wr, Tensor? w1, Tensor? b1, Tensor? w2, Tensor? b2, str activation, "
      "ScalarType out_dtype) -> Tensor");
  m.def(
      "lff_kernel_backward(Tensor grad, Tensor x, Tensor wr, Tensor? w1, Tensor? b1, Tensor? w2, Tensor? b2, "
      "str activation, bool[] needs) -> Tensor[]");
  m.def("encoding_kernel(Tensor positions, int dim, str kind, float base, float? block, ScalarType out_dtype) -> Tensor");
  m.def("encoding_add_kernel(Tensor x, Tensor positions, str kind, float base, float? block) -> Tensor");
  m.def("encoding_kernel_backward(Tensor grad, Tensor positions, int dim, str kind, float base) -> Tensor");
  m.def("lff_rotary_kernel(Tensor x, Tensor wr, ScalarType out_dtype) -> Tensor");
  m.def("lff_rotary_kernel_backward(Tensor grad, Tensor x, Tensor wr, bool need_x, bool need_wr) -> (Tensor, Tensor)");
  m.def("apply_lff_rotary_kernel(Tensor q, Tensor k, Tensor x, Tensor wr, str layout) -> (Tensor, Tensor)");
  m.def(
      "apply_lff_rotary_kernel_backward(Tensor gq, Tensor gk, Tensor q, Tensor k, Tensor x, Tensor wr, str layout, "
      "bool[] needs) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(posenc_fast, CPU, m) {
  m.impl("lff_kernel", &posenc_fast::fourier::lff_cpu);
  m.impl("lff_kernel_backward", &posenc_fast::fourier::lff_backward_cpu);
  m.impl("encoding_kernel", &posenc_fast::fourier::encoding_cpu);
  m.impl("encoding_add_kernel", &posenc_fast::fourier::encoding_add_cpu);
  m.impl("encoding_kernel_backward", &posenc_fast::fourier::encoding_backward_cpu);
  m.impl("lff_rotary_kernel", &posenc_fast::fourier::rotary_table_cpu);
  m.impl("lff_rotary_kernel_backward", &posenc_fast::fourier::rotary_table_backward_cpu);
  m.impl("apply_lff_rotary_kernel", &posenc_fast::fourier::rotary_apply_cpu);
  m.impl("apply_lff_rotary_kernel_backward", &posenc_fast::fourier::rotary_apply_backward_cpu);
}

TORCH_LIBRARY_IMPL(posenc_fast, Meta, m) {
  m.impl("lff_kernel", &posenc_fast::fourier::lff_meta);
  m.impl("lff_kernel_backward", &posenc_fast::fourier::lff_backward_meta);
  m.impl("encoding_kernel", &posenc_fast::fourier::encoding_meta);
  m.impl("encoding_add_kernel", &posenc_fast::fourier::encoding_add_meta);
  m.impl("encoding_kernel_backward", &posenc_fast::fourier::encoding_backward_meta);
  m.impl("lff_rotary_kernel", &posenc_fast::fourier::rotary_table_meta);
  m.impl("lff_rotary_kernel_backward", &posenc_fast::fourier::rotary_table_backward_meta);
  m.impl("apply_lff_rotary_kernel", &posenc_fast::fourier::rotary_apply_meta);
  m.impl("apply_lff_rotary_kernel_backward", &posenc_fast::fourier::rotary_apply_backward_meta);
}
