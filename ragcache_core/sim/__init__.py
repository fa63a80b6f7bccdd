"""Trace-driven simulator (`ragcache simulate`): the engine's tiers (vLLM's prefix-cached
blocks under LRU and the host tier, `EngineSimulator`) in time (`Simulator`: the admission
queue, TTFT), one replica or N behind a router (`ClusterSimulator`, `--replicas`)."""

from __future__ import annotations

from ragcache_core.sim.cluster import (
    ROUTINGS,
    ClusterConfig,
    ClusterResult,
    ClusterSimulator,
    simulate_cluster,
)
from ragcache_core.sim.engine import (
    EngineConfig,
    EngineRequest,
    EngineResult,
    EngineSimulator,
    Served,
)
from ragcache_core.sim.simulator import SimConfig, SimResult, Simulator, simulate
from ragcache_core.trace import TraceRequest, load_trace, parse_request, write_trace

__all__ = [
    "ROUTINGS",
    "ClusterConfig",
    "ClusterResult",
    "ClusterSimulator",
    "EngineConfig",
    "EngineRequest",
    "EngineResult",
    "EngineSimulator",
    "Served",
    "SimConfig",
    "SimResult",
    "Simulator",
    "TraceRequest",
    "load_trace",
    "parse_request",
    "simulate",
    "simulate_cluster",
    "write_trace",
]
