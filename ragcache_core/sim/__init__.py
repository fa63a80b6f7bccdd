"""Trace-driven simulator of the control plane (`ragcache simulate`)."""

from __future__ import annotations

from ragcache_core.sim.simulator import SimConfig, SimResult, Simulator, simulate
from ragcache_core.trace import TraceRequest, load_trace, parse_request, write_trace

__all__ = [
    "SimConfig",
    "SimResult",
    "Simulator",
    "TraceRequest",
    "load_trace",
    "parse_request",
    "simulate",
    "write_trace",
]
