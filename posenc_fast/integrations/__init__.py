"""Integrations with other libraries; each is imported on its own and only when used.

- :mod:`posenc_fast.integrations.timm`: learnable Fourier features or Sine-2D position
  encodings for a timm VisionTransformer (``use_lff(model)``, ``use_sine2d(model)``); the
  fused rotary op in timm's Eva-family models and NaFlexViT (``use_fast_rope(model)``).
- :mod:`posenc_fast.integrations.attention`: FLOATER Q/K/V biases for timm's Attention,
  torch's nn.MultiheadAttention and Hugging Face transformers' self-attention layers
  (``add_floater_biases(model)``).
- :mod:`posenc_fast.integrations.transformers`: Hugging Face transformers models (the
  FLOATER layers, ``use_lff`` for ViT/DeiT, ``use_fast_rotary`` for LightGlue,
  ``use_fast_rope`` for DINOv3 ViT, ``from_pretrained`` for models saved with them).

None imports the library it integrates with (except transformers.from_pretrained, which
needs its loaders, and timm's unfused attention path after use_fast_rope, which uses timm's
mask helpers of the model it runs): they work on the modules you pass, so importing
posenc_fast (or these modules) never imports timm or transformers.
"""
