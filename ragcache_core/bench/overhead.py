"""`ragcache bench overhead`: control-plane time per request at 10k and 100k cached nodes.

Per request it times what the request path does in the control plane: push into the
cache-aware queue and pop (reordering over a small backlog, scored by `Lifecycle.score`), match
+ pin + update + evict + plan and its check (`Lifecycle.open`) and the confirmation
(`Lifecycle.first_token`), through the runtime's own `Lifecycle`. The knowledge tree (its host
tier written at compute, so that every request plans stores) is first filled to the target
node count with a synthetic Zipf-popular document stream (top-3, 64-256 tokens per document),
sized so that every measured request evicts. Paper: < 1 ms per request; our target: p99 <
100 us.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import dataclass

from ragcache_core.policy import DEFAULT_POLICY
from ragcache_core.runtime.lifecycle import Lifecycle
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.runtime.reorder import CacheAwareQueue
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RootKey

_ROOT = RootKey("bench", "bench", "bench", "bench")


@dataclass(frozen=True, slots=True)
class OverheadResult:
    nodes: int
    requests: int
    policy: str
    p50_us: float
    p99_us: float
    mean_us: float
    max_us: float


class _Stream:
    """Reproducible requests: top-k doc sequences over a Zipf(1.0)-popular universe."""

    def __init__(self, num_docs: int, top_k: int, seed: int) -> None:
        self._rng = random.Random(seed)
        self._top_k = top_k
        self._docs = [
            DocSpec(DocKey(str(i), "h"), self._rng.randint(64, 256)) for i in range(num_docs)
        ]
        self._cum_weights = list(itertools.accumulate(1.0 / (i + 1) for i in range(num_docs)))

    def next(self) -> BuiltPrompt:
        """The next request's prompt: a 64-token root, its documents, a 32-token question
        (the tree reads only their lengths)."""
        picks = self._rng.choices(self._docs, cum_weights=self._cum_weights, k=self._top_k * 2)
        seen: dict[DocKey, DocSpec] = {}
        for spec in picks:
            seen.setdefault(spec.key, spec)
        docs = tuple(seen.values())[: self._top_k]
        return BuiltPrompt(
            root_ids=(0,) * 64,
            doc_ids=tuple((0,) * spec.num_tokens for spec in docs),
            question_ids=(0,) * 32,
            doc_specs=docs,
        )


def measure(
    nodes: int, requests: int = 2000, policy: str = DEFAULT_POLICY, seed: int = 0
) -> OverheadResult:
    """Fill a knowledge tree to about `nodes` nodes, then time `requests` requests."""
    page = 16
    avg_slots = 11  # mean of ceil(U(64, 256) / 16)
    total_slots = nodes * avg_slots
    tree = KnowledgeTree(_ROOT, host_slots=total_slots, page_size=page, policy=policy)
    lifecycle = Lifecycle.of(tree)
    stream = _Stream(num_docs=max(1000, nodes), top_k=3, seed=seed)
    guard = 0
    while tree.num_nodes < nodes and guard < 20 * nodes:
        lifecycle.first_token(lifecycle.open(stream.next(), final=True)[0])
        guard += 1
    queue: CacheAwareQueue[BuiltPrompt] = CacheAwareQueue(lifecycle.score, 16)
    for _ in range(7):
        queue.push(stream.next())
    samples: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(requests):
        incoming = stream.next()
        start = clock()
        queue.push(incoming)
        handle, _ = lifecycle.open(queue.pop(), final=True)
        lifecycle.first_token(handle)
        samples.append((clock() - start) / 1000)
    samples.sort()
    return OverheadResult(
        nodes=tree.num_nodes,
        requests=requests,
        policy=policy,
        p50_us=samples[len(samples) // 2],
        p99_us=samples[min(len(samples) - 1, int(0.99 * len(samples)))],
        mean_us=statistics.fmean(samples),
        max_us=samples[-1],
    )
