"""Weight-only GEMM over NVFP4 weights: E2M1 nibbles, an e4m3 scale per 16, one fp32 scale."""
