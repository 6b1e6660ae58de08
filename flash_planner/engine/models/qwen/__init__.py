"""The Qwen3.5/3.6 target: layers, full attention, Gated DeltaNet, MoE, the vision tower,
the forward's context and packing, the dense segments' boundary."""
