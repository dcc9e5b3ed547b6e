"""Runnable examples of the whole path (``examples/grpo.py``: an RL loop through the queue)."""
