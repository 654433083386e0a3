"""What every op package shares: its custom ops' eager fast path, their ONNX export
path, autocast handling, and the double-backward path of their autograd registrations.

ONNX export. Every ``posenc_fast::`` custom op is opaque to the ONNX exporters:
torch.onnx.export(dynamo=True) ends in "Failed to convert the exported program", the
TorchScript-based exporter in "unrecognized namespace posenc_fast". Two mechanisms could
fix that: an ONNX translation (an onnxscript function) per op, registered with the
exporter, or the op replaced by its plain-PyTorch composition while an ONNX export traces
it. The second is used: each :class:`CustomOp` names an ``onnx`` function, the op's forward
written with out-of-place ATen ops only (LFF and rotary: the ``*_autograd`` functions of
their torch_impl.py, which also build the double backward, so gradgradcheck tests them;
the encodings: ``encoding_graph``; FLOATER: the reference's solver loop, unrolled), all
checked by tests/common/test_onnx.py. While ``torch.onnx.is_in_onnx_export()`` is true
(set by both exporters; verified with torch 2.13), calling the op runs that function
instead, so the traced graph holds standard ops that every ONNX opset translates; nothing
depends on the exporter's private registry API, a user passes nothing (no
custom_translation_table), the same code serves both exporters, and dynamic batch /
sequence sizes stay symbolic. torch.export, AOTInductor and torch.compile
are unchanged: they still see the custom op (tests/common/test_compat.py). The
compositions run the phase reduction in float64 like the torch backend (docs/precision.md),
so the ONNX graph holds a few float64 ops (MatMul, Mul, Floor, Sub, Cast): onnxruntime
runs them (tested); a runtime without float64 support (TensorRT) cannot run that part
of the graph (docs/deploying.md).
"""

from __future__ import annotations

import contextlib
import typing
from typing import Callable, Optional

import torch
from torch import Tensor

from .._dispatch import Implementation
from ._custom_ops import onnx_exporting

# -- autocast --------------------------------------------------------------------------
# Kernels run with autocast off: precision is decided by the op's arguments. Custom ops
# have no autocast kernel, so autocast would otherwise still be active for the torch calls
# made inside an implementation and silently change its matmul precision. The public
# functions read the autocast state themselves and pass the output dtype explicitly.


def autocast_disabled(device_type: str):
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_dtype(device_type: str):
    """The autocast dtype active for ``device_type``, or None."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


# -- double backward -------------------------------------------------------------------


def differentiable_grads(
    recompute: Callable[[], Tensor],
    inputs,
    needs,
    grad: Tensor,
    zero_fill: bool = False,
) -> list[Optional[Tensor]]:
    """Gradients of ``recompute()`` (the op's output rebuilt from ``inputs`` with ops autograd
    can trace) as a differentiable graph of the inputs (create_graph=True), so that a
    double backward works. None where ``needs`` is False; where an input is needed but
    unused, None, or zeros of its shape with ``zero_fill``."""
    wanted = [t for t, n in zip(inputs, needs) if n]
    with autocast_disabled(grad.device.type), torch.enable_grad():
        y = recompute()
        got = iter(torch.autograd.grad(y, wanted, grad, create_graph=True, allow_unused=True))
    out: list[Optional[Tensor]] = []
    for t, n in zip(inputs, needs):
        g = next(got) if n else None
        if n and g is None and zero_fill:
            g = torch.zeros_like(t)
        out.append(g)
    return out


# -- custom ops and their eager fast path ----------------------------------------------

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def direct_call_ok(*args) -> bool:
    """Whether an op may run its body directly instead of going through its torch.library
    custom op: plain tensors (the Tensor arguments among ``args``) in plain eager mode.
    The custom op's dispatch and autograd wrapper cost 100-150 µs per training step on a
    CPU (a third of a small LFF call); everything that must see the op —
    torch.compile / export (dynamo), jit tracing, fake or functional tensors and other
    subclasses, dispatch and function modes (make_fx, FlopCounter, ``with
    torch.device(...)``), vmap / grad transforms, a running torch.profiler (whose
    trace names the op: examples/floater_attention.py counts integrations by it) — still
    goes through it. Private torch APIs are looked up defensively: where one is missing
    the op is used."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    C = torch._C
    try:
        if C._len_torch_dispatch_stack() or C._is_torch_function_mode_enabled():
            return False
        if C._autograd._profiler_enabled():
            return False
        if C._functorch.peek_interpreter_stack() is not None:
            return False
    except AttributeError:
        return False
    return all(type(a) in _PLAIN_TENSORS for a in args if isinstance(a, torch.Tensor))


def _same(*args):
    return args


def _resolve_annotations(body: Callable) -> None:
    """Replace ``body``'s annotations, strings under ``from __future__ import annotations``,
    by the objects they name. torch 2.5-2.6's ``infer_schema`` evaluates string annotations
    in its own module, where ``List`` and ``Optional`` exist but ``Tuple`` does not: a
    tuple return failed there ("Unsupported type annotation Tuple[Tensor, Tensor]. It is
    not a type"), which made ``import posenc_fast`` fail on torch 2.5."""
    body.__annotations__ = typing.get_type_hints(body)


from ._custom_ops import CUSTOM_OPS  # noqa: E402


class CustomOp:
    """A ``posenc_fast::`` torch.library custom op (its ``schema``, or one inferred from
    ``body``'s annotations, which spell lists ``typing.List``: torch 2.5's ``infer_schema``
    raises on ``list[...]``) with its fake kernel and autograd, plus the direct eager path
    every op shares: calling the object runs ``body`` itself (inside an autograd.Function
    with the same setup_context and backward, for an op with autograd) where
    :func:`direct_call_ok` (the op's dispatch costs more than a small call's work; the
    measurements are in docs/performance.md), and the registered op everywhere else.

    ``op_function``: the name of the Implementation function the op's body runs, so that
    :meth:`run` can call a ``differentiable`` implementation (the reference) without the op;
    ``impl_args`` maps the op's arguments to that function's where they differ (FLOATER's
    options travel as three scalars through the schema, as one object in Python).
    """

    def __init__(
        self,
        qualname: str,
        body: Callable,
        fake: Callable,
        *,
        backward: Optional[Callable] = None,
        setup_context: Optional[Callable] = None,
        op_function: str = "",
        impl_args: Optional[Callable] = None,
        tags: tuple = (),
        onnx: Optional[Callable] = None,
        schema: Optional[str] = None,
    ):
        kwargs = {"tags": tags} if tags else {}
        if schema is None:
            _resolve_annotations(body)
        else:
            kwargs["schema"] = schema
        self.op = torch.library.custom_op(qualname, body, mutates_args=(), **kwargs)
        self.op.register_fake(fake)
        CUSTOM_OPS.append(self)
        self.body = body
        self.schema = schema  # None: inferred from body's annotations
        self.op_function = op_function
        self.impl_args = impl_args
        # The op's plain-ATen composition, taking the op's own arguments: what an ONNX
        # export traces instead of the op (module docstring).
        self.onnx = onnx
        self._direct = None
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup_context)

            def forward(ctx, *inputs):
                out = body(*inputs)
                setup_context(ctx, inputs, out)
                return out

            # e.g. _LffDirect: its autograd node is _LffDirectBackward
            name = "".join(w.capitalize() for w in qualname.split("::")[-1].split("_"))
            self._direct = type(
                f"_{name}Direct",
                (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)},
            )

    def __call__(self, *args):
        if direct_call_ok(*args):
            return self._direct.apply(*args) if self._direct is not None else self.body(*args)
        # Checked only off the eager fast path: an ONNX export always traces.
        if self.onnx is not None and onnx_exporting():
            return self.onnx(*args)
        return self.op(*args)

    def run(self, impl: Implementation, *args):
        """The op on ``args`` (its arguments but the trailing backend name) with ``impl``:
        through the op (or its direct path), or for a ``differentiable`` implementation its
        function itself, which autograd differentiates."""
        if impl.differentiable:
            return getattr(impl, self.op_function)(*(self.impl_args or _same)(*args))
        return self(*args, impl.name)
