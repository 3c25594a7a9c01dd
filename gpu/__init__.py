"""Paged KV layout and paged attention on the hot tier (Torch everywhere, CuPy on CUDA)."""
