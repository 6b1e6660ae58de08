"""Acceptance of drafts against verify logits: strict and relaxed (top-k + logit margin)."""
