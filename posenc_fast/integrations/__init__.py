"""Integrations with other libraries; each is imported on its own and only when used.

- :mod:`posenc_fast.integrations.timm`: learnable Fourier features or Sine-2D position
  encodings for a timm VisionTransformer (``use_lff(model)``, ``use_sine2d(model)``).
- :mod:`posenc_fast.integrations.attention`: FLOATER Q/K/V biases for timm's Attention,
  torch's nn.MultiheadAttention and Hugging Face transformers' self-attention layers
  (``add_floater_biases(model)``).
- :mod:`posenc_fast.integrations.transformers`: Hugging Face transformers models (the
  FLOATER layers, ``use_lff`` for ViT/DeiT, ``use_fast_rotary`` for LightGlue,
  ``from_pretrained`` for models saved with them).

None imports the library it integrates with (except transformers.from_pretrained, which
needs its loaders): they work on the modules you pass, so importing posenc_fast (or these
modules) never imports timm or transformers.
"""
