"""Registers the posenc_fast:: custom ops (import side effect)."""

from . import encodings, fourier_features

__all__ = ["encodings", "fourier_features"]
