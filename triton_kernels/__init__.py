"""Triton kernels of posenc_fast, installed as ``posenc_fast.triton_kernels``.

(Never as a top-level ``triton_kernels``: that import name belongs to another project of
the Triton ecosystem.) Importing this package imports triton.
"""
