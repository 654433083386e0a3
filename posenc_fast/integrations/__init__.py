"""Integrations with other libraries, each imported on its own when used:

- :mod:`.timm`: ``use_lff`` / ``use_sine2d`` (ViT patch grids), ``use_fast_rope`` (Eva
  family, NaFlexViT).
- :mod:`.attention`: ``add_floater_biases`` (timm Attention, nn.MultiheadAttention,
  transformers self-attention).
- :mod:`.transformers`: ``use_lff`` (ViT/DeiT), ``use_fast_rotary`` (LightGlue),
  ``use_fast_rope`` (DINOv3 ViT), ``from_pretrained``.

They work on the modules passed and never import timm or transformers themselves (except
transformers.from_pretrained and timm's unfused attention path after use_fast_rope).
"""
