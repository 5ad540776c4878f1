"""asyncrl: asynchronous, streaming RL post-training for language models on Ray Serve."""

__version__ = "0.1.0"
