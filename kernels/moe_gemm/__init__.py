"""Mixture-of-experts grouped GEMM over float, FP8, NVFP4 or int4 expert weights."""
