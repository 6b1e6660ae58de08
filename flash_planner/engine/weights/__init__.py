"""Quantized weights: the packed formats, their checkpoint layouts and quantize-at-load."""
