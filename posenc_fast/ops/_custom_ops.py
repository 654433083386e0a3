"""What every op's custom op shares: its registration, the eager path that skips its
dispatch, the ONNX switch to its plain-ATen composition, autocast, and double backward.

Each op is an ``autograd.Function`` whose ``forward`` is also the body of a
``posenc_fast::`` custom op: :func:`run` calls the Function directly for plain tensors in
plain eager mode (skipping the op's dispatch), the custom op everywhere else (torch.compile
and export see one opaque op), and while an ONNX exporter traces, the Function's ``onnx``
composition (plain ATen ops, with double backward: docs/deploying.md)."""

from __future__ import annotations

import contextlib
import typing
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .._dispatch import Implementation


class Registered(NamedTuple):
    """One custom op as registered: its op, body and schema (None: inferred)."""

    op: object  # torch.library.CustomOpDef
    body: Callable
    schema: Optional[str]


# Every custom op made, in order: what the compatibility tests walk.
CUSTOM_OPS: list[Registered] = []


def custom_op(
    name: str,
    body: Callable,
    fake: Callable,
    *,
    backward: Optional[Callable] = None,
    setup_context: Optional[Callable] = None,
    schema: Optional[str] = None,
    tags: tuple = (),
):
    """``body`` registered as the op ``posenc_fast::<name>`` with its fake kernel and, for
    an op with a gradient, its autograd (``backward`` and ``setup_context``). The schema
    is inferred from body's annotations unless given (they spell lists ``typing.List``:
    torch 2.5's infer_schema refuses ``list[...]``)."""
    kwargs = {"tags": tags} if tags else {}
    if schema is None:
        # torch 2.5-2.6 evaluate string annotations in their own module, where Tuple is
        # missing: give them the objects.
        body.__annotations__ = typing.get_type_hints(body)
    else:
        kwargs["schema"] = schema
    op = torch.library.custom_op(f"posenc_fast::{name}", body, mutates_args=(), **kwargs)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    CUSTOM_OPS.append(Registered(op, body, schema))
    return op


_PLAIN = (Tensor, torch.nn.Parameter)


def run(function, op, impl: Implementation, *args):
    """The op on ``args`` (its arguments but the backend's name) with ``impl``:

    - the reference (no backward): its forward, which autograd differentiates;
    - plain tensors in plain eager mode: the autograd.Function ``function`` when a
      gradient is wanted, else the implementation itself (skipping the custom op's
      dispatch);
    - while an ONNX exporter traces: ``function.onnx``, the plain-ATen composition;
    - everywhere else (torch.compile, export, fake tensors, subclasses, modes, vmap, a
      running profiler): the custom op, which those must see.
    Kernels run with autocast off: the public functions pass the output dtype."""
    if impl.backward is None:
        return impl.forward(*args)
    grad = plain_eager_grad(args)
    if grad is None:
        if onnx_exporting():
            return function.onnx(*args)
        return op(*args, impl.name)
    if grad:
        return fast_apply(function)(*args, impl.name)
    with autocast_disabled(args[0].device.type):
        return impl.forward(*args)


def plain_eager_grad(args) -> Optional[bool]:
    """None unless ``args`` hold plain tensors only (no subclass, no functorch wrapper) and
    torch runs in plain eager mode; else whether autograd wants a gradient of them.
    Private torch APIs are looked up defensively: where one is missing, None."""
    if torch.compiler.is_compiling():  # first: dynamo traces nothing else here
        return None
    grad = False
    try:
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        for a in args:
            if isinstance(a, Tensor):
                if type(a) not in _PLAIN or wrapped(a):
                    return None
                grad = grad or a.requires_grad
        C = torch._C
        if (
            C._get_tracing_state() is not None
            or C._len_torch_dispatch_stack()
            or C._is_torch_function_mode_enabled()
            or C._autograd._profiler_enabled()
            or C._functorch.peek_interpreter_stack() is not None
        ):
            return None
    except AttributeError:
        return None
    return grad and torch.is_grad_enabled()


def direct_call_ok(*args) -> bool:
    """Whether an op may run without its custom op: plain tensors (the Tensor arguments
    among ``args``) in plain eager mode (see :func:`run`)."""
    return plain_eager_grad(args) is not None


_APPLY: dict = {}


def fast_apply(function):
    """``function.apply`` without autograd.Function's Python wrapper, whose work
    :func:`plain_eager_grad` has done (no functorch transform, no wrapped tensor, no
    setup_context)."""
    apply = _APPLY.get(function)
    if apply is None:
        apply = _APPLY[function] = super(torch.autograd.Function, function).apply
    return apply


# -- autocast --------------------------------------------------------------------------
# Kernels run with autocast off: the public functions pass the output dtype explicitly.


_NO_CONTEXT = contextlib.nullcontext()  # reusable: it holds no state
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)  # a cheap test


def _autocast_on(device_type: str) -> bool:
    return (
        _any_autocast()
        and device_type in ("cpu", "cuda")
        and torch.is_autocast_enabled(device_type)
    )


def autocast_disabled(device_type: str):
    return torch.autocast(device_type, enabled=False) if _autocast_on(device_type) else _NO_CONTEXT


def autocast_dtype(device_type: str):
    """The autocast dtype active for ``device_type``, or None."""
    return torch.get_autocast_dtype(device_type) if _autocast_on(device_type) else None


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


# -- ONNX export -----------------------------------------------------------------------


def _onnx_export_flags() -> Callable[[], bool]:
    """A cheap ``torch.onnx.is_in_onnx_export()``: the public function imports two modules
    on every call, so the two flags it reads are looked up once; where a torch lays them
    out otherwise, the public function itself."""
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

        if hasattr(_flags, "_is_onnx_exporting") and hasattr(GLOBALS, "in_onnx_export"):
            return lambda: bool(GLOBALS.in_onnx_export or _flags._is_onnx_exporting)
    except ImportError:
        pass
    return lambda: bool(torch.onnx.is_in_onnx_export())


_onnx_flags: list[Callable[[], bool]] = []


def onnx_exporting() -> bool:
    """Whether an ONNX exporter (dynamo-based or TorchScript-based) is tracing this call."""
    if torch.compiler.is_compiling():  # dynamo folds the public function to False
        return bool(torch.onnx.is_in_onnx_export())
    if not _onnx_flags:
        _onnx_flags.append(_onnx_export_flags())
    return _onnx_flags[0]()


@torch._dynamo.assume_constant_result
def onnx_export_running() -> bool:
    """Whether an ONNX exporter is running, also while dynamo traces: the dynamo exporter
    falls back to a strict (dynamo) capture when the first one fails, and there
    onnx_exporting() is False. Dynamo runs this function for real and keeps the answer."""
    if not _onnx_flags:
        _onnx_flags.append(_onnx_export_flags())
    return _onnx_flags[0]()
