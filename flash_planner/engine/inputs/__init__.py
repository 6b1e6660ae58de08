"""What a request brings to the model: chat templates, JSON-Schema grammars, images and
their rotary positions. May import the engine's config, loop/'s acceptance and constraint,
the models and the kernels; never the run (engine.py, decoding.py, batch.py, generate.py)."""
