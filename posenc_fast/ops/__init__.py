"""Registers the posenc_fast:: custom ops (import side effect)."""

from . import encodings, floater, fourier_features, rotary

__all__ = ["encodings", "floater", "fourier_features", "rotary"]
