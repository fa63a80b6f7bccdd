"""What the host tier fuzz (tests/_host_tier_model.py) exercised, summed over its scenarios."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counts:
    """What the scenarios exercised (printed once; asserted to be nonzero)."""

    scenarios: int = 0
    actions: int = 0
    steps: int = 0
    requests: int = 0
    host_loads: int = 0
    """Load spans read (wholly or in part) from the host pool."""
    host_tokens: int = 0
    copied_loads: int = 0
    """Of those, spans from copies the tree had not applied (`EvictionWindow.copied_loads`)."""
    victim_loads: int = 0
    """Load spans read from slots the plan's lease lent as a victim."""
    copies: int = 0
    handout_copies: int = 0
    """Copies the window made as vLLM handed a block of their document out."""
    no_lease: int = 0
    """Kept documents lost for lack of lease room (reported)."""
    failed_copies: int = 0
    overwrites: int = 0
    refused_tokens: int = 0
    """Tokens the scheduler side refused to load past an overwritten victim (`load_limit`)."""
    reports: int = 0
    late_reports: int = 0
    """Reports applied after a report the engine produced later."""
    lost_reports: int = 0
    aborts: int = 0
    restarts: int = 0
    after_restart: int = 0
    """Reports of a dead engine that reached the app after the restart (to be ignored)."""
    preemptions: int = 0
    invalidations: int = 0
    clears: int = 0

    def add(self, other: Counts) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))
