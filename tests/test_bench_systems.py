"""The systems of `bench serve`: what each proxy of vLLM's own CPU offloading sets, and the
refusal of the systems that need a CUDA vLLM (no engine is started here)."""

from __future__ import annotations

import pytest

from ragcache_core.bench.serve import baseline_settings
from ragcache_core.bench.systems import CUDA_ONLY, MAIN_SYSTEMS, SYSTEMS
from ragcache_core.config import CacheConfig
from ragcache_core.engine.settings import detect_device
from ragcache_core.errors import ConfigError

FCFS = {"reorder": False, "speculation": False}

# What each proxy must set itself, whatever RAGCache's defaults become (docs/benchmarks.md,
# "Systems", names the vLLM file and behaviour each models).
PROXIES = {
    "ragcache-offload-proxy": {"policy": "lru", "host_write": "compute", **FCFS},
    "ragcache-offload-proxy-arc": {"policy": "arc", "host_write": "compute", **FCFS},
    "ragcache-offload-proxy-lazy": {
        "policy": "lru",
        "host_write": "eviction",
        "host_write_at_handout": False,  # vLLM's lazy offload copies what its walk sees
        "host_write_window_tokens": 4096,
        "host_write_return": "tail",
        **FCFS,
    },
}


@pytest.mark.parametrize("name", sorted(PROXIES))
def test_each_proxy_sets_what_it_models_explicitly(name: str) -> None:
    spec = SYSTEMS[name]
    assert spec.kind == "ragcache" and name in MAIN_SYSTEMS and not spec.cuda_only
    assert dict(spec.changes) == PROXIES[name]
    config = CacheConfig(host_pool_tokens=4096).with_(**spec.changes)  # a valid config
    for key, value in PROXIES[name].items():
        assert getattr(config, key) == value


def test_proxies_do_not_follow_a_changed_default() -> None:
    """A default switched (the lead's host_write="eviction") leaves the write-through proxies
    writing through."""
    base = CacheConfig(host_pool_tokens=4096, host_write="eviction")
    for name in ("ragcache-offload-proxy", "ragcache-offload-proxy-arc"):
        assert base.with_(**SYSTEMS[name].changes).host_write == "compute"


@pytest.mark.parametrize("name", sorted(n for n, s in SYSTEMS.items() if s.kind == "ragcache"))
def test_every_ragcache_system_is_a_valid_config(name: str) -> None:
    config = CacheConfig(host_pool_tokens=4096).with_(**SYSTEMS[name].changes)
    for key, value in SYSTEMS[name].changes.items():
        assert getattr(config, key) == value


def test_the_policy_ablations_change_only_the_policy() -> None:
    assert dict(SYSTEMS["ragcache-lfu"].changes) == {"policy": "lfu"}
    assert dict(SYSTEMS["ragcache-lru"].changes) == {"policy": "lru"}


def test_cuda_only_systems_are_the_two_vllm_offloads() -> None:
    assert CUDA_ONLY == ("vllm-offload", "vllm-offload-lazy")
    assert all(SYSTEMS[n].kind == "vllm" for n in CUDA_ONLY)


@pytest.mark.skipif(detect_device().is_cuda, reason="refused only where no CUDA device is")
@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("vllm-offload", "CPU Offloading is currently only supported on CUDA-alike"),
        ("vllm-offload-lazy", "SimpleCPUOffloadConnector copies with CUDA streams"),
    ],
)
def test_cuda_only_systems_are_refused_in_one_line_before_any_model_is_read(
    name: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        baseline_settings(name, "/no/such/model", CacheConfig(host_pool_tokens=4096))
    message = str(info.value)
    assert reason in message and "\n" not in message and message.startswith(name)


def test_only_plain_vllm_caches_nothing() -> None:
    """The demo skips the warm-up of a system that keeps no KV between requests."""
    keeps_nothing = {name for name, spec in SYSTEMS.items() if not spec.caches}
    assert keeps_nothing == {"vllm", "vllm-noconn"}
