"""Base config: model / train / data defaults (see m2r2_jax/training/config.py for every field)."""

from m2r2_jax.training.config import base_config


def get_config():
    return base_config()
