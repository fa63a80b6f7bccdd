"""Helpers for tests, benchmarks and the demo: offline model builder and shared engines."""

from ragcache_core.testing.tiny_model import build_tiny_model, default_model_dir, recipe_for

__all__ = ["build_tiny_model", "default_model_dir", "recipe_for"]
