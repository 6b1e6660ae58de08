"""Training the shipped planner models from scratch: synthetic corpus, tokenizer, models.

`corpus` generates the deterministic synthetic robot-task corpus (with a held-out split of
unseen combinations) and renders examples as chat text; `tokenizer` trains the byte-level BPE
tokenizer with the ChatML template the planner uses.
"""
