"""The speculative loop's parts: proposers (DFlash, MTP, auto, replay) and their windows, the
acceptance policies (strict, relaxed, sampled), the grammar's constraint on a block, and one
cycle of draft, verify, decide and commit (speculative.py). May import state/, models/,
weights/, the engine's config, checkpoint and telemetry, and the kernels; never inputs/ or
the run (engine.py, decoding.py, batch.py, generate.py)."""
