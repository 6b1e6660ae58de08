"""Qwen3.8-Flash-Next (qwen4_exp): its target and MTP head on the Qwen layers, the n-gram
PLE tables, hyper-connections and the sparse-attention indexer."""
