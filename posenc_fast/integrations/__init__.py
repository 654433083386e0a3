"""Integrations with other libraries; each is imported on its own and only when used.

- :mod:`posenc_fast.integrations.timm`: learnable Fourier features or Sine-2D position
  encodings for a timm VisionTransformer (``use_lff(model)``, ``use_sine2d(model)``).
- :mod:`posenc_fast.integrations.attention`: FLOATER Q/K/V biases for timm's Attention and
  torch's nn.MultiheadAttention (``add_floater_biases(model)``).

Neither imports the library it integrates with: they work on the modules you pass, so
importing posenc_fast (or these modules) never imports timm.
"""
