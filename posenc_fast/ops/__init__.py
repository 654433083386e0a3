"""The ops, one package each: ``lff``, ``encodings``, ``rotary``, ``floater``; each with
``api.py`` (public functions and modules), ``op.py`` (custom ops with autograd),
``reference.py`` (float64), ``torch_impl.py`` and ``registry.py``. Shared:
``_custom_ops.py`` and ``_torch_math.py``; the dispatcher is ``posenc_fast._dispatch``."""
