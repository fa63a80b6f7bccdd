"""N replicas behind a router: the simulator's cluster mode (`ragcache simulate --replicas N`).

Each replica is one `Simulator`: one simulated engine (vLLM's blocks and the host tier,
`sim/engine.py`; the capacities are per replica). The router places requests one at a time in
arrival order; each replica serves its own requests FCFS, one at a time, so a replica's caches
see its requests in arrival order and the hit rates do not depend on arrival times (TTFT
does: wait for the replica, then its time to first token).

Routing policies (`ROUTINGS`):
- `round_robin`: request i to replica i mod N.
- `prefix_affinity`: a model of vllm-router's `cache_aware` (text-prefix affinity). The router
  keeps its own tree of the prompts it sent to each replica (system prompt, documents in order,
  question); a request goes to the replica whose tree matches the longest prefix if the
  matched share of its prompt exceeds `match_threshold`, else to the replica with the smallest
  router tree; when the loads are imbalanced (max - min > `balance_abs` and max >
  `balance_rel` x min) it goes to the least-loaded replica. The router never learns about
  evictions (as in the real one), and a question never matches another question.
- `doc_affinity`: consistent hashing of the first document's id (what vllm-router's
  `consistent_hash` does on the `X-Session-Id` header RAGCacheClient sets) with a load bound:
  bounded-load consistent hashing (Mirrokni, Thorup, Zadimoghaddam 2018). A replica is full when
  it holds `ceil(load_factor x (recent + 1) / N)` of the `recent` requests in the load window;
  a request walks the ring from its key to the first replica that is not full.
- `doc_affinity_unbounded`: the same ring without the bound (plain `consistent_hash`).
- `oracle`: knows every replica's tree; the replica with the most cached tokens for the
  request among those not full (same bound), ties to the least loaded.

Load = requests a replica received among the last `load_window x N` routed requests. Load
imbalance is measured on consecutive windows of `imbalance_window x N` requests: per window,
the busiest replica's requests over the mean.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ragcache_core.cost import CopyCost, CostModel
from ragcache_core.errors import ConfigError
from ragcache_core.sim.engine import ratio
from ragcache_core.sim.simulator import SimConfig, SimResult, Simulator, Tally, p95
from ragcache_core.trace import TraceRequest

ROUTINGS = ("round_robin", "prefix_affinity", "doc_affinity", "doc_affinity_unbounded", "oracle")
VIRTUAL_NODES = 160  # per replica, as vllm-router's consistent_hash


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """`replica`: each replica's capacities and policy. `load_factor`: the bound c (>= 1) of
    the load-bounded policies. Windows are in requests per replica."""

    replicas: int
    replica: SimConfig
    routing: str = "doc_affinity"
    load_factor: float = 1.25
    load_window: int = 32
    imbalance_window: int = 64
    match_threshold: float = 0.3
    balance_abs: int = 32
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.routing not in ROUTINGS:
            raise ConfigError(
                f"unknown routing {self.routing!r}; choose one of {', '.join(ROUTINGS)}"
            )
        if not self.load_factor >= 1.0:
            raise ConfigError(f"load_factor must be >= 1, got {self.load_factor}")
        if self.load_window < 1 or self.imbalance_window < 1:
            raise ConfigError("load_window and imbalance_window must be >= 1")
        if self.replica.reorder:
            raise ConfigError("cluster mode serves each replica FCFS, one request at a time")


@dataclass(frozen=True, slots=True)
class ClusterResult:
    """Totals of one `ClusterSimulator.run`; hit rates are over every replica's requests."""

    replicas: int
    routing: str
    requests: int
    doc_hit_rate: float
    token_hit_rate: float
    requests_per_replica: tuple[int, ...]
    busiest_share: float
    imbalance_mean: float
    imbalance_max: float
    ttft_mean_s: float
    ttft_p95_s: float
    per_replica: tuple[SimResult, ...] = field(repr=False)

    def to_json(self, *, per_replica: bool = False) -> dict[str, Any]:
        out = asdict(self)
        out["requests_per_replica"] = list(self.requests_per_replica)
        if per_replica:
            out["per_replica"] = [r.to_json() for r in self.per_replica]
        else:
            del out["per_replica"]
        return out


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class Loads:
    """Requests per replica among the last `window` routed ones (mutated by `add`)."""

    def __init__(self, replicas: int, window: int) -> None:
        self.counts = [0] * replicas
        self._recent: deque[int] = deque()
        self._window = window

    def add(self, replica: int) -> None:
        self._recent.append(replica)
        self.counts[replica] += 1
        if len(self._recent) > self._window:
            self.counts[self._recent.popleft()] -= 1

    def capacity(self, load_factor: float) -> int:
        """Most requests a replica may hold in the window and still take one more."""
        return math.ceil(load_factor * (len(self._recent) + 1) / len(self.counts))

    def least_loaded(self, among: Sequence[int]) -> int:
        return min(among, key=lambda i: (self.counts[i], i))


class Router(Protocol):
    def choose(self, request: TraceRequest, loads: Loads) -> int:
        """The replica for `request` (may update the router's own state)."""
        ...


class RoundRobin:
    def __init__(self, replicas: int) -> None:
        self._n = replicas
        self._next = 0

    def choose(self, request: TraceRequest, loads: Loads) -> int:
        replica = self._next
        self._next = (self._next + 1) % self._n
        return replica


class HashRing:
    """Consistent-hash ring, `VIRTUAL_NODES` points per replica (sha256, stable across runs)."""

    def __init__(self, replicas: int) -> None:
        points = sorted(
            (_hash64(f"replica-{r}:{v}"), r) for r in range(replicas) for v in range(VIRTUAL_NODES)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]
        self._n = replicas
        self._orders: dict[str, list[int]] = {}

    def order(self, key: str) -> list[int]:
        """Every replica once, in ring order from `key`'s point (cached per key)."""
        found = self._orders.get(key)
        if found is None:
            start = bisect.bisect_right(self._hashes, _hash64(key))
            found, seen = [], set()
            for step in range(len(self._owners)):
                owner = self._owners[(start + step) % len(self._owners)]
                if owner not in seen:
                    seen.add(owner)
                    found.append(owner)
                    if len(found) == self._n:
                        break
            self._orders[key] = found
        return found


class DocAffinity:
    """First-document consistent hashing; with `load_factor`, bounded-load (walk the ring past
    full replicas). A request without documents goes to the least-loaded replica."""

    def __init__(self, replicas: int, load_factor: float | None) -> None:
        self._ring = HashRing(replicas)
        self._load_factor = load_factor
        self._all = range(replicas)

    def choose(self, request: TraceRequest, loads: Loads) -> int:
        if not request.docs:
            return loads.least_loaded(self._all)
        order = self._ring.order(request.docs[0])
        if self._load_factor is None:
            return order[0]
        cap = loads.capacity(self._load_factor)
        return next(r for r in order if loads.counts[r] < cap)


class PrefixAffinity:
    """The model of `cache_aware` described in the module docstring."""

    def __init__(self, config: ClusterConfig) -> None:
        self._config = config
        self._seen: list[set[tuple[str, ...]]] = [set() for _ in range(config.replicas)]
        self._tree_tokens = [0] * config.replicas
        self._all = range(config.replicas)

    def _matched(self, replica: int, request: TraceRequest) -> int:
        seen, tokens = self._seen[replica], 0
        for depth in range(1, len(request.docs) + 1):
            if request.docs[:depth] not in seen:
                break
            tokens += request.doc_tokens[depth - 1]
        return tokens

    def choose(self, request: TraceRequest, loads: Loads) -> int:
        cfg = self._config
        system = cfg.replica.system_tokens
        total = system + sum(request.doc_tokens) + request.question_tokens
        counts = loads.counts
        if max(counts) - min(counts) > cfg.balance_abs and max(counts) > cfg.balance_rel * min(
            counts
        ):
            replica = loads.least_loaded(self._all)
        else:
            matched = [self._matched(r, request) for r in self._all]
            best = max(matched)
            if ratio(system + best, total) > cfg.match_threshold:
                replica = loads.least_loaded([r for r in self._all if matched[r] == best])
            else:
                replica = min(self._all, key=lambda r: (self._tree_tokens[r], counts[r], r))
        self._insert(replica, request, total)
        return replica

    def _insert(self, replica: int, request: TraceRequest, total: int) -> None:
        """Add the prompt to the replica's router tree: its size grows by the text not
        already there (the system prompt once, the unmatched documents, the question)."""
        known = self._matched(replica, request)
        if self._tree_tokens[replica]:
            known += self._config.replica.system_tokens
        for depth in range(1, len(request.docs) + 1):
            self._seen[replica].add(request.docs[:depth])
        self._tree_tokens[replica] += total - known


class Oracle:
    """Most cached tokens among the replicas under the load bound; ties to the least loaded."""

    def __init__(self, sims: Sequence[Simulator], load_factor: float) -> None:
        self._sims = sims
        self._load_factor = load_factor

    def choose(self, request: TraceRequest, loads: Loads) -> int:
        cap = loads.capacity(self._load_factor)
        open_ = [r for r in range(len(self._sims)) if loads.counts[r] < cap]
        cached = {r: self._sims[r].score(self._sims[r].request(request))[0] for r in open_}
        return min(open_, key=lambda r: (-cached[r], loads.counts[r], r))


def make_router(config: ClusterConfig, sims: Sequence[Simulator]) -> Router:
    if config.routing == "round_robin":
        return RoundRobin(config.replicas)
    if config.routing == "prefix_affinity":
        return PrefixAffinity(config)
    if config.routing == "doc_affinity":
        return DocAffinity(config.replicas, config.load_factor)
    if config.routing == "doc_affinity_unbounded":
        return DocAffinity(config.replicas, None)
    return Oracle(sims, config.load_factor)


class ClusterSimulator:
    """N `Simulator`s behind one router; the caches persist across `run` calls."""

    def __init__(
        self,
        config: ClusterConfig,
        cost_model: CostModel | None = None,
        copies: CopyCost | None = None,
    ) -> None:
        self.config = config
        self.sims = [Simulator(config.replica, cost_model, copies) for _ in range(config.replicas)]
        self.router = make_router(config, self.sims)
        self.loads = Loads(config.replicas, config.load_window * config.replicas)

    def run(self, requests: list[TraceRequest]) -> ClusterResult:
        """Route and serve `requests` in arrival order (ties keep file order)."""
        n = self.config.replicas
        tallies = [Tally() for _ in range(n)]
        free_at = [0.0] * n
        routed: list[int] = []
        for request in sorted(requests, key=lambda r: r.arrival_s):
            replica = self.router.choose(request, self.loads)
            self.loads.add(replica)
            routed.append(replica)
            sim = self.sims[replica]
            start = max(request.arrival_s, free_at[replica])
            served = sim.serve(sim.request(request))
            free_at[replica] = start + served.first_token_s + served.after_s
            tallies[replica].add(served, start - request.arrival_s)
        per_replica = tuple(t.result(s.engine) for t, s in zip(tallies, self.sims, strict=True))
        return self._result(routed, tallies, per_replica)

    def _result(
        self, routed: list[int], tallies: list[Tally], per_replica: tuple[SimResult, ...]
    ) -> ClusterResult:
        n = self.config.replicas
        counts = tuple(r.requests for r in per_replica)
        ratios = window_imbalance(routed, n, self.config.imbalance_window * n)
        ttfts = [t for tally in tallies for t in tally.ttfts]
        return ClusterResult(
            replicas=n,
            routing=self.config.routing,
            requests=len(routed),
            doc_hit_rate=ratio(sum(t.cached for t in tallies), sum(t.requested for t in tallies)),
            token_hit_rate=ratio(
                sum(t.cached_doc_tokens for t in tallies), sum(t.doc_tokens for t in tallies)
            ),
            requests_per_replica=counts,
            busiest_share=ratio(max(counts), len(routed)),
            imbalance_mean=ratio(sum(ratios), len(ratios)),
            imbalance_max=max(ratios, default=0.0),
            ttft_mean_s=ratio(sum(ttfts), len(ttfts)),
            ttft_p95_s=p95(ttfts),
            per_replica=per_replica,
        )


def window_imbalance(routed: Sequence[int], replicas: int, window: int) -> list[float]:
    """Per consecutive window of `window` routed requests (a last partial window counts if it
    holds at least half a window): the busiest replica's count over the mean count."""
    ratios = []
    for start in range(0, len(routed), window):
        chunk = routed[start : start + window]
        if start and len(chunk) < window / 2:
            break
        counts = [0] * replicas
        for replica in chunk:
            counts[replica] += 1
        ratios.append(max(counts) / (len(chunk) / replicas))
    return ratios


def simulate_cluster(
    requests: list[TraceRequest],
    config: ClusterConfig,
    cost_model: CostModel | None = None,
    copies: CopyCost | None = None,
) -> ClusterResult:
    """One fresh cluster, one run."""
    return ClusterSimulator(config, cost_model, copies).run(requests)
