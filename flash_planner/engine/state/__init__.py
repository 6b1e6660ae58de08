"""The inference state a forward reads and writes: KV cache with its FP8 scales, GDN state
and a verify's kept rows, batch slots, prefix snapshots, Flash-Next's windows, and the bytes
a cycle moves (traffic.py). May import the engine's config and the kernels only."""
