"""Learnable Fourier features (Li et al. 2021): functional ``lff`` and the nn.Module.

Path of a call: ``lff`` (checks, dtype policy) -> the registry's implementation
(registry.py) -> the custom op ``posenc_fast::lff`` (op.py) -> its kernel; the backward
(``posenc_fast::lff_backward``) recomputes from x."""

from __future__ import annotations

import math
from functools import cache
from typing import Optional

import torch
from torch import Tensor, nn

from ... import _checks, _dispatch
from ..._dispatch import Problem
from ..._modules import module_tensors
from .._custom_ops import autocast_dtype, run
from . import checkpoint
from . import reference as _reference
from .activations import ACTIVATIONS
from .op import LFF_OP, LffFunction
from .registry import LFF


def _check_lff_args(x, wr, w1, b1, w2, b2, activation) -> tuple[Tensor, bool]:
    """The checked positions (integers converted to float) and whether the MLP is given.
    A few attribute reads on the happy path; the detailed check runs only on failure."""
    _checks.real_positions("x", x)
    _checks.float_tensor("wr", wr)
    xs, ws = x.shape, wr.shape
    if len(xs) < 2:
        raise ValueError(
            f"x must have shape [..., G, M] (at least 2 dimensions), got {list(x.shape)}"
        )
    M = xs[-1]
    # M = 0 or F = 0 would make every feature constant (and the torch backend divides by
    # sqrt(F)): like the module (pos_dim, fourier_dim > 0), refuse them here.
    if M == 0:
        raise ValueError(
            f"x must have shape [..., G, M] with M >= 1 coordinates, got {list(x.shape)}"
        )
    if len(ws) != 2 or ws[1] != M or ws[0] == 0:
        _checks.frequencies("wr", wr, M)
    device, dtype = wr.device, wr.dtype
    mlp = not (w1 is None and b1 is None and w2 is None and b2 is None)
    if mlp and not _mlp_ok(2 * ws[0], dtype, device, w1, b1, w2, b2):
        _check_mlp(wr, w1, b1, w2, b2)
        _checks.same_device("wr", wr, w1=w1, b1=b1, w2=w2, b2=b2)
        _checks.same_dtype("wr", wr, w1=w1, b1=b1, w2=w2, b2=b2)
    if x.device != device:
        _checks.same_device("wr", wr, x=x)
    if activation not in ACTIVATIONS:
        _checks.choice("activation", activation, ACTIVATIONS)
    if not x.is_floating_point():
        # Integer positions: exact in float32 up to 2^24 (float64 for float64 weights).
        x = x.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return x, mlp


def _mlp_ok(F: int, dtype, device, w1, b1, w2, b2) -> bool:
    """Whether the MLP's weights are w1 [F, H], b1 [H], w2 [H, D/G], b2 [D/G], all of
    ``dtype`` on ``device``."""
    if not (
        isinstance(w1, Tensor)
        and isinstance(b1, Tensor)
        and isinstance(w2, Tensor)
        and isinstance(b2, Tensor)
    ):
        return False
    s1, sb1, s2, sb2 = w1.shape, b1.shape, w2.shape, b2.shape
    return (
        len(s1) == 2
        and len(sb1) == 1
        and len(s2) == 2
        and len(sb2) == 1
        and s1[0] == F
        and sb1[0] == s1[1] == s2[0]
        and sb2[0] == s2[1]
        and w1.dtype == dtype
        and b1.dtype == dtype
        and w2.dtype == dtype
        and b2.dtype == dtype
        and w1.device == device
        and b1.device == device
        and w2.device == device
        and b2.device == device
    )


def _check_mlp(wr, w1, b1, w2, b2) -> None:
    """The detailed check of the MLP's weights, naming what is wrong."""
    mlp_args = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    given = [name for name, t in mlp_args.items() if t is not None]
    if len(given) != 4:
        missing = [n for n in mlp_args if n not in given]
        raise ValueError(f"w1, b1, w2 and b2 must be given together (missing {', '.join(missing)})")
    for name, t in mlp_args.items():
        _checks.float_tensor(name, t)
    F = 2 * wr.shape[0]
    _checks.shape("w1", w1, (F, None), "[F, H] with F = 2 * wr.shape[0]")
    H = w1.shape[1]
    _checks.shape("b1", b1, (H,), "[H] with H = w1.shape[1]")
    _checks.shape("w2", w2, (H, None), "[H, D/G] with H = w1.shape[1]")
    _checks.shape("b2", b2, (w2.shape[1],), "[D/G] with D/G = w2.shape[1]")


def lff(
    x: Tensor,
    wr: Tensor,
    w1: Optional[Tensor] = None,
    b1: Optional[Tensor] = None,
    w2: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    activation: str = "gelu",
    backend: str = "auto",
) -> Tensor:
    """Learnable Fourier features followed by the grouped MLP (Algorithm 1 of Li et al.).

    Args:
        x: positions [..., G, M] (floating or integer; integers are converted).
        wr: frequencies [F/2, M].
        w1 [F, H], b1 [H], w2 [H, D/G], b2 [D/G]: the MLP shared by all groups; all four
            or none. Without them the features themselves are returned.
        activation: "gelu" (erf form), "gelu_tanh" or "relu".
        backend: "auto", "reference", "torch", "triton" or "cpp".

    Returns:
        [..., D] with D = G * D/G: y[..., g*D/G + j] = y_g[..., j]; without the MLP the
        features [cos(x wr^T) || sin(x wr^T)] / sqrt(F) of every group, [..., G * F].
        The dtype is the weights' dtype (the autocast dtype under autocast); phases are
        always computed in float32 or better and reduced accurately (docs/precision.md).
    """
    x, mlp = _check_lff_args(x, wr, w1, b1, w2, b2, activation)
    amp = autocast_dtype(x.device.type)
    out_dtype = amp if amp is not None and wr.dtype == torch.float32 else wr.dtype
    sizes = {
        "pos_dim": x.shape[-1],
        "fourier_dim": 2 * wr.shape[0],
        "hidden_dim": w1.shape[1] if mlp else 0,
        "group_out_dim": w2.shape[1] if mlp else 0,
    }
    problem = Problem("lff", x.device.type, out_dtype, sizes, {"activation": activation},
                      {"x": x.dtype})  # fmt: skip
    impl = _dispatch.choose(LFF, problem, backend)
    return run(LffFunction, LFF_OP, impl, x, wr, w1, b1, w2, b2, activation, out_dtype)


_WEIGHTS = ("wr", "w1", "b1", "w2", "b2")

# The scale of the initial output across positions: that of a learned position table at
# initialisation (timm's ViT pos_embed: trunc_normal, std 0.02), so that LFF can replace
# such a table without changing the balance between token and position at step 0.
INIT_OUTPUT_STD = 0.02


@cache
def activation_moments(activation: str) -> tuple[float, float]:
    """(mean, variance) of act(z) for z ~ N(0, 1), by trapezoid quadrature in float64 on
    [-12, 12] (within 1e-7)."""
    z = torch.linspace(-12.0, 12.0, 24001, dtype=torch.float64)
    density = torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    a = _reference.activation(activation, z)
    mean = torch.trapezoid(a * density, z).item()
    second = torch.trapezoid(a * a * density, z).item()
    return mean, second - mean * mean


class LearnableFourierFeatures(nn.Module):
    r"""Learnable Fourier features + grouped MLP positional encoding (Li et al. 2021).

    ``x [..., G, M] -> [..., D]``. Parameters follow Algorithm 1 (M = pos_dim,
    F = fourier_dim, H = hidden_dim, D = out_dim, G = groups):

    - ``wr`` [F/2, M], initialised from N(0, gamma^-2) (std 1/gamma, the paper's Eq. 3).
      gamma is the kernel width in units of the positions: features of positions delta
      apart have cosine similarity exp(-delta^2 / (2 gamma^2)). Choose it on the scale of
      the positions you feed in (docs/ops/lff.md, "Choosing gamma").
    - ``w1`` [F, H], ``b1`` [H], ``w2`` [H, D/G], ``b2`` [D/G]: one MLP serves every group.
      Initialised so that LFF can stand in for a learned position table (docs/ops/lff.md,
      "Initialisation"): w1 ~ N(0, 2), b1 = 0; w2 ~ N(0, s^2) with s = INIT_OUTPUT_STD /
      sqrt(H * Var[act(z)]) and b2 = -E[act(z)] * w2.sum(0): output mean ~0, std ~0.02 per
      channel. With ``layer_norm=True``: w1 ~ N(0, 1/F), w2 ~ N(0, 0.02^2 / H), zero biases.
    - ``learnable=False``: wr is a buffer (the paper's Fixed-Fourier variant).
    - ``mlp=False``: return the features, concatenated over groups: hidden_dim is not used
      and out_dim, if given, must be G*F.
    - ``layer_norm=True``: a LayerNorm before each of the two dense projections;
      ``dropout``: dropout after the activation (the appendix's Reformer setting). These
      run as plain PyTorch after the (fused) feature op.
    - ``kl=True``: a learnable target variance for :meth:`kl_regularizer`, initialised to
      gamma^-2 (appendix Eq. 9). It is registered only then: a parameter that forward does
      not use breaks DistributedDataParallel's default settings.
    """

    def __init__(
        self,
        pos_dim: int,
        fourier_dim: int,
        hidden_dim: Optional[int] = None,
        out_dim: Optional[int] = None,
        groups: int = 1,
        gamma: float = 1.0,
        learnable: bool = True,
        mlp: bool = True,
        activation: str = "gelu",
        layer_norm: bool = False,
        dropout: float = 0.0,
        kl: bool = False,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        _checks.positive_int("pos_dim", pos_dim)
        _checks.even_positive_int("fourier_dim", fourier_dim)
        _checks.positive_int("groups", groups)
        if out_dim is None and not mlp:
            out_dim = groups * fourier_dim
        missing = [n for n, v in (("hidden_dim", hidden_dim), ("out_dim", out_dim)) if v is None]
        if mlp and missing:
            names = " and ".join(missing)
            raise TypeError(f"{names} must be given with mlp=True (the MLP's sizes)")
        _checks.positive_int("out_dim", out_dim)
        _checks.positive_float("gamma", gamma)
        _checks.choice("activation", activation, ACTIVATIONS)
        if dtype is not None:  # before torch refuses an integer Parameter less clearly
            _checks.float_dtype("dtype", dtype)
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, (int, float))
            or not 0.0 <= dropout < 1.0
        ):
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        if mlp:
            _checks.positive_int("hidden_dim", hidden_dim)
            if out_dim % groups:
                raise ValueError(f"out_dim ({out_dim}) must be divisible by groups ({groups})")
        else:
            if out_dim != groups * fourier_dim:
                raise ValueError(
                    "with mlp=False out_dim must equal groups * fourier_dim = "
                    f"{groups * fourier_dim}, got {out_dim}"
                )
            if layer_norm or dropout:
                raise ValueError("layer_norm and dropout apply to the MLP: they need mlp=True")
        if not mlp:
            hidden_dim = None  # no hidden layer
        self.pos_dim, self.fourier_dim, self.hidden_dim = pos_dim, fourier_dim, hidden_dim
        self.out_dim, self.groups, self.gamma = out_dim, groups, float(gamma)
        self.learnable, self.mlp, self.activation = learnable, mlp, activation
        self.layer_norm, self.dropout, self.kl = layer_norm, float(dropout), kl
        self.backend = _dispatch.validate_name(backend)

        factory = {"device": device, "dtype": dtype}
        wr = torch.empty(fourier_dim // 2, pos_dim, **factory)
        if learnable:
            self.wr = nn.Parameter(wr)
        else:
            self.register_buffer("wr", wr)
        if mlp:
            group_out = out_dim // groups
            self.w1 = nn.Parameter(torch.empty(fourier_dim, hidden_dim, **factory))
            self.b1 = nn.Parameter(torch.empty(hidden_dim, **factory))
            self.w2 = nn.Parameter(torch.empty(hidden_dim, group_out, **factory))
            self.b2 = nn.Parameter(torch.empty(group_out, **factory))
            if layer_norm:
                self.norm1 = nn.LayerNorm(fourier_dim, **factory)
                self.norm2 = nn.LayerNorm(hidden_dim, **factory)
        if kl:
            # Stored as a log so the learned variance stays positive under any optimizer.
            self.kl_log_target_var = nn.Parameter(torch.empty((), **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.wr.normal_(0.0, 1.0 / self.gamma)
            if self.mlp:
                self._reset_mlp()
                if self.layer_norm:
                    self.norm1.reset_parameters()
                    self.norm2.reset_parameters()
            if self.kl:
                self.kl_log_target_var.fill_(-2.0 * math.log(self.gamma))

    def _reset_mlp(self) -> None:
        """The MLP's initialisation (the class docstring says what and why)."""
        if self.layer_norm:  # unit-variance features and hidden units
            w1_std, (act_mean, act_var) = 1.0 / math.sqrt(self.fourier_dim), (0.0, 1.0)
        else:  # features of squared norm 1/2; hidden units act(z), z ~ N(0, 1)
            w1_std, (act_mean, act_var) = math.sqrt(2.0), activation_moments(self.activation)
        self.w1.normal_(0.0, w1_std)
        self.b1.zero_()
        self.w2.normal_(0.0, INIT_OUTPUT_STD / math.sqrt(self.hidden_dim * act_var))
        # The hidden units' mean act_mean would add a constant offset to every position.
        self.b2.copy_(-act_mean * self.w2.sum(0))

    @classmethod
    def from_state_dict(cls, state_dict, source: str, **kwargs) -> LearnableFourierFeatures:
        """Load a checkpoint of a public LFF module ("guimont", "jhlew", "lightglue",
        "tpe") with its gamma convention and weight layout (checkpoint.py; the arguments:
        :func:`posenc_fast.convert.from_state_dict`; ``convert.to_state_dict`` is the
        reverse)."""
        args, kw, weights = checkpoint.parse(state_dict, source, **kwargs)
        m = cls(*args, **kw)
        with torch.no_grad():
            for name, w in weights.items():
                getattr(m, name).copy_(w)
        return m

    @property
    def target_var(self) -> Tensor:
        """The KL target variance: learnable with kl=True, else fixed at gamma^-2."""
        if self.kl:
            return self.kl_log_target_var.exp()
        return torch.tensor(self.gamma**-2, dtype=self.wr.dtype, device=self.wr.device)

    def kl_regularizer(self) -> Tensor:
        """Appendix Eq. 9: KL(N(mu, sigma^2) || N(0, target_var)) of wr's entries.

        mu and sigma^2 are the empirical (population) mean and variance of wr. Add
        ``alpha * m.kl_regularizer()`` to the loss (Eq. 10; the paper uses alpha = 1).
        Without kl=True the target is the fixed initial variance gamma^-2."""
        w = self.wr.flatten()
        mu = w.mean()
        var = w.var(unbiased=False)
        t = self.target_var
        return -0.5 * (1.0 - torch.log(t) + torch.log(var) - (var + mu * mu) / t)

    def _check_input(self, x) -> None:
        _checks.real_positions("x", x)
        if x.dim() < 2 or x.shape[-2:] != (self.groups, self.pos_dim):
            # Scalar positions [...] are not guessed (a [1, 1] input reads both ways):
            # with one group of one coordinate they are x[..., None, None].
            hint = ""
            if self.groups == 1 and self.pos_dim == 1:
                hint = "; scalar positions p [...] go in as p[..., None, None]"
            raise ValueError(
                f"x must have shape [..., groups={self.groups}, pos_dim={self.pos_dim}], "
                f"got {list(x.shape)}{hint}"
            )

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if not self.mlp:
            return lff(x, self.wr, backend=self.backend)
        dropout_active = self.training and self.dropout > 0
        if not (self.layer_norm or dropout_active):
            wr, w1, b1, w2, b2 = module_tensors(self, _WEIGHTS)
            return lff(x, wr, w1, b1, w2, b2, self.activation, self.backend)
        return self._forward_unfused(x, dropout_active)

    def _forward_unfused(self, x: Tensor, dropout_active: bool) -> Tensor:
        """LayerNorm / dropout variant: fused features, then the MLP in plain PyTorch."""
        r = lff(x, self.wr, backend=self.backend)  # [..., G * F]
        r = r.unflatten(-1, (self.groups, self.fourier_dim))
        if self.layer_norm:
            r = self.norm1(r)
        h = _reference.activation(self.activation, r @ self.w1.to(r.dtype) + self.b1.to(r.dtype))
        if dropout_active:
            h = nn.functional.dropout(h, self.dropout, training=True)
        if self.layer_norm:
            h = self.norm2(h)
        y = h @ self.w2.to(h.dtype) + self.b2.to(h.dtype)
        return y.flatten(-2)

    def extra_repr(self) -> str:
        s = f"pos_dim={self.pos_dim}, fourier_dim={self.fourier_dim}, "
        if self.mlp:
            s += f"hidden_dim={self.hidden_dim}, "
        s += f"out_dim={self.out_dim}, groups={self.groups}, gamma={self.gamma}"
        if not self.learnable:
            s += ", learnable=False"
        if not self.mlp:
            s += ", mlp=False"
        if self.activation != "gelu":
            s += f", activation={self.activation!r}"
        if self.layer_norm:
            s += ", layer_norm=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.kl:
            s += ", kl=True"
        if self.backend != "auto":
            s += f", backend={self.backend!r}"
        return s
