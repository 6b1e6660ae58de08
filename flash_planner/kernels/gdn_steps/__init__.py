"""Gated delta rule over a short block, emitting the state after every step."""
