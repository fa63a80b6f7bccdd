"""Helpers for tests and benchmarks: vLLM engines shared across tests (`engines`). The models
they run are made by `ragcache_core.models`."""
