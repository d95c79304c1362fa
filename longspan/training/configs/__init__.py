"""The config dataclasses, split by topic; import them from ``longspan.training.config``."""
