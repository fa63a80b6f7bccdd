"""Trace-driven simulator of the control plane (`ragcache simulate`), one replica or N
behind a router (`--replicas`)."""

from __future__ import annotations

from ragcache_core.sim.cluster import (
    ROUTINGS,
    ClusterConfig,
    ClusterResult,
    ClusterSimulator,
    simulate_cluster,
)
from ragcache_core.sim.resample import ResampleFit, fit_zipf, resample
from ragcache_core.sim.simulator import SimConfig, SimResult, Simulator, simulate
from ragcache_core.trace import TraceRequest, load_trace, parse_request, write_trace

__all__ = [
    "ROUTINGS",
    "ClusterConfig",
    "ClusterResult",
    "ClusterSimulator",
    "ResampleFit",
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
