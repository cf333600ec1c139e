"""Commands that drive the engine: run, warm, serve."""
