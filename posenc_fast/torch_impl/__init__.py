"""Pure-PyTorch implementations behind the "torch" backend (CPU and GPU fallback)."""
