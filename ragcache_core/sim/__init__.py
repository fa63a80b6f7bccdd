"""Trace-driven simulator of the control plane (`ragcache simulate`), one replica or N
behind a router (`--replicas`), over the paper's two pools (`Simulator`) or over the engine's
tiers (`EngineSimulator`: vLLM's prefix-cached blocks and the host tier, `--engine`)."""

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
from ragcache_core.sim.resample import ResampleFit, fit_zipf, resample
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
    "ResampleFit",
    "Served",
    "SimConfig",
    "SimResult",
    "Simulator",
    "TraceRequest",
    "fit_zipf",
    "load_trace",
    "parse_request",
    "resample",
    "simulate",
    "simulate_cluster",
    "write_trace",
]
