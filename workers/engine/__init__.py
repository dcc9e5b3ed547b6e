"""One vLLM engine, driven for tasks: the engine host and what a sample carries out of it."""
