"""The "torch" backend: pure PyTorch, every device, every floating dtype.

The fallback wherever no compiled kernel fits. Memory-efficient (chunked, recomputing
backward) and accurate (float64 phase reduction); see posenc_fast/torch_impl/.
"""

from __future__ import annotations

import torch

from ..torch_impl import encodings as _enc
from ..torch_impl import floater as _floater
from ..torch_impl import fourier_features as _lff
from ..torch_impl import rotary as _rotary
from ._base import ANY, Backend, OpSupport

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class TorchBackend(Backend):
    name = "torch"
    summary = "pure PyTorch, chunked and recomputing: the fallback on every device"
    SUPPORT = {
        "lff": OpSupport(devices=ANY, dtypes=_FLOATS),
        "encoding": OpSupport(devices=ANY, dtypes=_FLOATS),
        "encoding_nd": OpSupport(devices=ANY, dtypes=_FLOATS),
        "floater": OpSupport(devices=ANY, dtypes=(torch.float32, torch.float64)),
        "lff_rotary": OpSupport(devices=ANY, dtypes=_FLOATS),
        "apply_lff_rotary": OpSupport(devices=ANY, dtypes=_FLOATS),
    }

    lff_forward = staticmethod(_lff.lff_forward)
    lff_backward = staticmethod(_lff.lff_backward)
    encoding_forward = staticmethod(_enc.encoding_forward)
    encoding_add = staticmethod(_enc.encoding_add)
    encoding_backward = staticmethod(_enc.encoding_backward)
    floater_forward = staticmethod(_floater.floater_forward)
    floater_backward = staticmethod(_floater.floater_backward)
    lff_rotary_forward = staticmethod(_rotary.table_forward)
    lff_rotary_backward = staticmethod(_rotary.table_backward)
    apply_lff_rotary_forward = staticmethod(_rotary.apply_forward)
    apply_lff_rotary_backward = staticmethod(_rotary.apply_backward)
