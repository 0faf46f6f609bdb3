"""specrl: reinforcement learning for speculative-decoding policies."""

__version__ = "0.1.0"
