"""Registers the posenc_fast:: custom ops (import side effect)."""

from . import encodings, floater, fourier_features

__all__ = ["encodings", "floater", "fourier_features"]
