"""Weight-only GEMMs (FP8, NVFP4, int4; float and quantized experts): one format table
(formats.py), two Triton kernels (tiled.py for prefill chunks, skinny.py for decode and
verify, split along K) built from one set of tile decoders (tiles.py), their references
(reference.py), launchers with the references' signatures (ops.py), launch configurations
(configs.py) and each device's state (context.py), measured by tune.py."""
