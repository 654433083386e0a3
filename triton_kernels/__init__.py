"""Triton kernels of posenc_fast, installed as ``posenc_fast.triton_kernels``.

(Never as a top-level ``triton_kernels``: that import name belongs to another project of
the Triton ecosystem.) Importing the package itself imports nothing; its kernel modules
(``lff_forward``, ``lff_backward``, ``encodings``, ``rotary``) import triton, ``_env``
does not. The kernel layer never imports posenc_fast's dispatcher or op packages."""
