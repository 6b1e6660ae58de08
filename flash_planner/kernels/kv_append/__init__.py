"""KV cache append (optionally FP8 e4m3 with per-kv-head scales) and dequantizing read."""
