"""Everything that runs on a GPU (or CPU) host: one worker node, one vLLM engine."""

__all__: list[str] = []
