"""Target and drafter modules, written in plain torch with HF parameter names."""
