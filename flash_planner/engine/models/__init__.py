"""Target and drafter modules, written in plain torch with HF parameter names, by family:
qwen/ (the Qwen3.5/3.6 target's layers), flash_next/ (Qwen3.8-Flash-Next's parts),
drafters/ (DFlash, MTP), graphs/ (the compiled static-shape forwards). May import state/,
weights/, the engine's config and the kernels; never loop/, inputs/ or the run."""
