"""shoal: an elastic, fair, heterogeneity-aware scheduler for deep-learning training."""

__version__ = "0.1.0"
