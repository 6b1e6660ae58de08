"""Gated delta rule over a block; a verify keeps its rows for gdn_commit instead of the state."""
