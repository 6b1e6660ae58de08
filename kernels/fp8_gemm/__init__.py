"""Weight-only GEMM over FP8 e4m3 weights with block scales (W8A16)."""
