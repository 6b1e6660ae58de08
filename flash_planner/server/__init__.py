"""The OpenAI-compatible HTTP server (`flash-planner serve`)."""
