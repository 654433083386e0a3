"""The ops, one package each: ``lff``, ``encodings``, ``rotary``, ``floater``.

Each holds its public API (``api.py``: functions and modules; FLOATER's in
``functional.py``, ``module.py`` and ``attention_bias.py``), its ``posenc_fast::`` custom
ops with autograd (``op.py``), its float64 reference (``reference.py``), its pure-PyTorch
implementation (``torch_impl.py``) and one small registry pairing every implementation
with its SUPPORT table (``registry.py``). Shared by them: ``_custom_ops.py`` (custom-op
registration, eager fast path, ONNX switch, autocast, double backward) and
``_torch_math.py`` (accurate phases, chunking, device constants); the dispatcher is
``posenc_fast._dispatch``.
"""
