"""The float64 reference: the papers' equations, literally. Every backend is tested
against these functions; they are differentiable and favour readability over speed."""

from . import encodings, floater, fourier_features, rotary

__all__ = ["encodings", "floater", "fourier_features", "rotary"]
