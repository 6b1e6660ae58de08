"""Weight-only GEMM over int4 weights with per-group scales and zero points (W4A16)."""
