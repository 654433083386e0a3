"""The "reference" backend: the literal float64 equations (posenc_fast/reference).

It is the specification, differentiable through autograd, and never chosen by "auto".
Calls that name it bypass the custom ops: the public functions call the reference directly.
"""

from __future__ import annotations

import torch

from ._base import ANY, Backend, OpSupport

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ReferenceBackend(Backend):
    name = "reference"
    summary = "literal float64 equations: the specification every backend is tested against"
    SUPPORT = {
        "lff": OpSupport(devices=ANY, dtypes=_FLOATS),
        "encoding": OpSupport(devices=ANY, dtypes=_FLOATS),
        "encoding_nd": OpSupport(devices=ANY, dtypes=_FLOATS),
        "floater": OpSupport(devices=ANY, dtypes=(torch.float32, torch.float64)),
        "lff_rotary": OpSupport(devices=ANY, dtypes=_FLOATS),
        "apply_lff_rotary": OpSupport(devices=ANY, dtypes=_FLOATS),
    }
