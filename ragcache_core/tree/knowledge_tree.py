"""KnowledgeTree: the knowledge tree over the engine's tiers, its policy, and the per-request
planner.

The single source of truth of what is cached where (docs/design.md 2.1-2.3, 3.2). Pure bookkeeping:
it decides and returns `Plan`s; the data plane copies the bytes. A small manager over three
parts, each of which changes only what its docstring says:

  * `PrefixTree` (prefix.py): nodes by path, the walk, attach/detach, the document index;
  * `Placement` (placement.py): copies over the slot tiers (the host tier), pins, make room,
    eviction (slots: tier_slots.py, allocator.py);
  * `Planner` (planner.py): `begin_request` and its steps, access statistics, store policy;
  * `HostWrites` (host_writes.py): eviction-time host writes (keeps, the host lease, reports).

Who decides what: the policy decides host admission (with the store policy) and host eviction;
vLLM's LRU decides what leaves vLLM's blocks (the tree only hears of it, `Node.resident`); the
connector executes the plans.

Request lifecycle:

    handle = cache.begin_request(root_tokens, docs, question_tokens, root_key=key)  # plan
    ... connector executes handle.plan: load, (forward), store or keep ...
    cache.confirm(handle)   # its stores ran: written copies become readable; unpin
    cache.abort(handle)     # or: the request died; its unconfirmed copies are dropped; unpin
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ragcache_core.capacity import slots_in_tokens
from ragcache_core.cost import CostModel, default_cost_model
from ragcache_core.errors import ConfigError, RAGCacheError
from ragcache_core.plan import NO_LOSSES, Tier, WindowLosses
from ragcache_core.policy import DEFAULT_POLICY, make_policy
from ragcache_core.tree.host_writes import HostWrites
from ragcache_core.tree.integrity import OpenHoldings, fail
from ragcache_core.tree.keys import DocKey, DocSpec, RootKey
from ragcache_core.tree.match import MatchResult
from ragcache_core.tree.node import Node
from ragcache_core.tree.order import ordered_hits
from ragcache_core.tree.placement import Placement
from ragcache_core.tree.planner import STORE_POLICIES, Planner
from ragcache_core.tree.prefix import PrefixTree, match_result, readable_prefix
from ragcache_core.tree.request import RequestHandle, RequestState
from ragcache_core.tree.stats import CacheStats, TreeCounters


class KnowledgeTree:
    """Knowledge tree + host slot tier + replacement policy: a forest with one root per
    root key (the template and system prompt before the documents, and a tenant's salt),
    under one memory budget and one policy. `root_key` is the default root, used by requests
    that name none. Roots are evicted like other nodes (a leaf root, then with its subtree
    when it is left without a copy).

    Not thread-safe: its one owner at run time (`runtime.lifecycle.Lifecycle`, on RAGCache's
    loop) calls it from one thread (or one event loop).
    `max_depth` caches only the first j documents of a sequence (paper 2.7; None: all).
    `frequency_window` restarts the frequencies (and DGDSF's decayed ones) every that many
    final requests (None: frequencies last until `clear()`).
    The tiers it models (docs/design.md 2.2): vLLM's blocks, held and evicted by vLLM (known
    as `Node.resident`), and the slot tiers below them: the host tier of `host_slots` slots
    of `page_size` tokens, written by its write rule (`host_write`).
    `store_policy` decides which computed documents are stored: "always" (the paper), "second"
    (only a document met before at the same prefix: one-off documents never cost a store or
    an eviction) or "no_evict" (only while free room is left: stores never evict).
    `block_size` is vLLM's block size (default `page_size`).
    `host_write` is when the host tier is written: "compute" (as documents are computed: plans
    store them) or "eviction" (as they leave vLLM's blocks: plans keep them and lend
    `host_lease_slots` host slots for the copies, a lease that grows to `host_lease_max_slots`
    while copies outrun it, topped up with victims, host copies still served until the engine
    overwrites one, unless `host_lease_victims` is False; `HostWrites`, docs/design.md 2.2);
    the store policy decides which documents are stored or kept either way.
    Raises `ConfigError` for settings out of range.
    """

    def __init__(
        self,
        root_key: RootKey,
        *,
        host_slots: int,
        page_size: int,
        policy: str = DEFAULT_POLICY,
        cost_model: CostModel | None = None,
        max_depth: int | None = None,
        frequency_window: int | None = None,
        store_policy: str = "always",
        block_size: int | None = None,
        host_write: str = "compute",
        host_lease_slots: int = 0,
        host_lease_max_slots: int | None = None,
        host_lease_victims: bool = True,
    ) -> None:
        if max_depth is not None and max_depth < 0:
            raise ConfigError(f"max_depth cannot be negative, got {max_depth}")
        if frequency_window is not None and frequency_window <= 0:
            raise ConfigError(f"frequency_window must be positive, got {frequency_window}")
        if host_write not in ("compute", "eviction"):
            raise ConfigError(f"unknown host_write {host_write!r}; choose compute or eviction")
        if host_lease_slots < 0:
            raise ConfigError(f"host_lease_slots cannot be negative, got {host_lease_slots}")
        if host_lease_max_slots is not None and host_lease_max_slots < host_lease_slots:
            raise ConfigError(
                f"host_lease_max_slots ({host_lease_max_slots}) is below host_lease_slots "
                f"({host_lease_slots})"
            )
        if store_policy not in STORE_POLICIES:
            raise ConfigError(
                f"unknown store_policy {store_policy!r}; choose one of {', '.join(STORE_POLICIES)}"
            )
        self.root_key = root_key
        self.engine_generation = 0
        """How many engines were lost (`drop_tier(Tier.GPU)`): a request planned now runs on
        engine `engine_generation`, and its report is applied only while that engine lives."""
        self.page_size = page_size
        self.policy = make_policy(policy)
        self._prefixes = PrefixTree(root_key)
        self._placement = Placement(
            self._prefixes,
            self.policy,
            host_slots=host_slots,
            page_size=page_size,
        )
        self.host_writes: HostWrites | None = (
            HostWrites(
                self._prefixes,
                self._placement,
                lease_slots=host_lease_slots,
                max_lease_slots=host_lease_max_slots,
                victims=host_lease_victims,
            )
            if host_write == "eviction"
            else None
        )
        """Eviction-time host writes (read freely; None: the host tier is written at compute)."""
        self._planner = Planner(
            self._prefixes,
            self._placement,
            page_size=page_size,
            cost_model=cost_model or default_cost_model(),
            max_depth=max_depth,
            frequency_window=frequency_window,
            store_policy=store_policy,
            host_writes=self.host_writes,
        )
        self.block_size = block_size or page_size
        """vLLM's block size (the GPU tier's unit; the host page size where none is given)."""
        self._next_request_id = 0
        self._open: dict[int, RequestHandle] = {}

    @classmethod
    def from_tokens(
        cls,
        root_key: RootKey,
        *,
        host_tokens: int,
        page_size: int,
        **kwargs: object,
    ) -> KnowledgeTree:
        """The host tier's capacity in tokens (rounded down to whole slots of `page_size`
        tokens)."""
        return cls(
            root_key,
            host_slots=slots_in_tokens(host_tokens, page_size),
            page_size=page_size,
            **kwargs,  # type: ignore[arg-type]
        )

    # The planner's settings, read-only here (one copy of each).
    @property
    def cost_model(self) -> CostModel:
        return self._planner.cost_model

    @property
    def max_depth(self) -> int | None:
        return self._planner.max_depth

    @property
    def frequency_window(self) -> int | None:
        return self._planner.frequency_window

    @property
    def store_policy(self) -> str:
        return self._planner.store_policy

    # ------------------------------------------------------------------ queries (no mutation)

    def match(
        self, docs: Sequence[DocKey | DocSpec], root_key: RootKey | None = None
    ) -> MatchResult:
        """The readable cached prefix of `docs` under `root_key` (None: the default root; the
        root first). Does not modify the cache. O(h)."""
        keys = [d.key if isinstance(d, DocSpec) else d for d in docs]
        path = self._prefixes.walk(keys, root_key)
        return match_result(path, readable_prefix(path))

    def cached_tokens(self, docs: Sequence[DocSpec], root_key: RootKey | None = None) -> int:
        """`match(docs, root_key).cached_tokens` without building the result (the reordering
        queue's hot path). Does not modify the cache. O(h)."""
        total = 0
        for node in self._prefixes.walk([spec.key for spec in docs], root_key):
            if not node.cached:  # in flight: nothing below it is readable either
                break
            total += node.num_tokens
        return total

    def cache_order(
        self, docs: Sequence[DocSpec | str], root_key: RootKey | None = None
    ) -> tuple[int, ...]:
        """The order of `docs` (given in retrieval order) that follows this tree's readable
        cached path under `root_key`, as retrieval ranks (`tree.order.cache_order`; bounded by
        `max_depth`; a bare document id matches any node of that id). Does not modify the cache."""
        return ordered_hits(self._prefixes, docs, root_key, self.max_depth)[0]

    def ordered_hits(
        self, docs: Sequence[DocSpec | str], root_key: RootKey | None = None
    ) -> tuple[tuple[int, ...], int]:
        """`cache_order(docs, root_key)` and the cached tokens that order reads, the root's
        included (the reordering queue's score of a cache-ordered request). Does not modify
        the cache."""
        return ordered_hits(self._prefixes, docs, root_key, self.max_depth)

    @property
    def num_nodes(self) -> int:
        """Nodes holding a copy (ready or in flight), the roots included."""
        return self._prefixes.num_nodes

    @property
    def num_roots(self) -> int:
        """Roots holding a copy (one per template/system prompt/salt in use)."""
        return self._prefixes.num_roots

    @property
    def counters(self) -> TreeCounters:
        """Host evictions and host slots written since creation or the last `clear()` (a
        snapshot)."""
        return self._placement.counters

    def stats(self) -> CacheStats:
        host = self._placement.tiers[Tier.HOST].allocator
        return CacheStats(
            nodes=self.num_nodes,
            host_slots=host.num_slots,
            host_used_slots=host.num_used - len(self._placement.host_lease),
            pinned_nodes=self._placement.pinned_nodes(),
            open_requests=len(self._open),
            page_size=self.page_size,
            roots=self.num_roots,
        )

    def iter_nodes(self) -> Iterator[Node]:
        """Every attached node that holds a copy, parents before children (for checks/tests)."""
        return self._prefixes.iter_nodes()

    # ------------------------------------------------------------------ request lifecycle

    def begin_request(
        self,
        root_tokens: int,
        docs: Sequence[DocSpec],
        question_tokens: int,
        *,
        final: bool = True,
        root_key: RootKey | None = None,
    ) -> RequestHandle:
        """Match, pin, evict and allocate for one request under root `root_key` (None: the
        default root); return its handle and plan.

        Mutates the tree, the tiers and the policy state. The caller must later call exactly
        one of `confirm(handle)` or `abort(handle)`. Never fails for lack of room: without room
        the request stores fewer (or no) nodes. Raises `InputError` (changing nothing) for
        negative sizes, a root size that differs from the cached root's or a document size
        that differs from its cached node's.
        """
        handle = self._planner.begin_request(
            self._next_request_id,
            root_key or self.root_key,
            root_tokens,
            docs,
            question_tokens,
            final=final,
        )
        self._next_request_id += 1
        handle.engine_generation = self.engine_generation
        self._open[handle.request_id] = handle
        self._placement.compact()
        return handle

    def confirm(self, handle: RequestHandle) -> None:
        """The request's copies are known to be complete (the runtime confirms at the request's
        first token, which proves its stores ran; the synchronous path when the connector's
        final report says so): copies it wrote become readable; release its pins and held
        slots. Raises `RAGCacheError` if the handle is not open."""
        self._check_open(handle)
        self._placement.publish(handle)
        if self.host_writes is not None:
            self.host_writes.settle(handle)
        self._finish(handle, RequestState.CONFIRMED)

    def abort(self, handle: RequestHandle) -> None:
        """The request failed or was aborted after the engine stopped executing it: drop every
        copy it was writing (nodes left without a copy leave the tree with their subtrees),
        release pins and held slots. Raises `RAGCacheError` if the handle is not open."""
        self._check_open(handle)
        self._placement.discard_written(handle)
        self._finish(handle, RequestState.ABORTED)

    def apply_host_writes(
        self,
        copied: Sequence[tuple[int, int, tuple[int, ...]]],
        dropped: Sequence[int],
        stranded_blocks: int = 0,
        gone: Sequence[tuple[int, int]] = (),
        lost: WindowLosses = NO_LOSSES,
        overwritten: Sequence[tuple[int, int]] = (),
        *,
        engine_generation: int | None = None,
    ) -> None:
        """The engine's report of eviction-time host writes (any request's report carries the
        changes since the previous one; each copy is applied once): lent victims the engine
        overwrote leave the host tier, copies become ready host copies, and the paths `gone`
        from vLLM's blocks stop being held there (`HostWrites.apply`). No-op when the host
        tier is written at compute.

        `engine_generation`: the generation of the engine that made the report (the
        `engine_generation` of the request it came with, taken when it was planned; None: the
        current one). A report of an engine lost since (`drop_tier`) is ignored and counted
        (`HostWrites.stale_reports`): that engine's unreported copies are lost, and its
        numbers would hide the new engine's, which numbers from 1 again."""
        if self.host_writes is not None:
            if engine_generation is not None and engine_generation != self.engine_generation:
                self.host_writes.stale_reports += 1
                return
            self.host_writes.apply(
                tuple(copied),
                tuple(dropped),
                stranded_blocks,
                tuple(gone),
                lost,
                tuple(overwritten),
            )

    def mark_final(self, handle: RequestHandle) -> None:
        """A speculative request turned out to use the final documents: count its retrievals
        toward frequency now. No-op for a request that was final already."""
        self._planner.mark_final(handle)

    # ------------------------------------------------------------------ maintenance

    def drop_tier(self, tier: Tier) -> None:
        """Every copy in `tier` is gone (e.g. the GPU worker died). Aborts every open request
        first; nodes keeping a confirmed copy elsewhere survive, the rest leave the tree."""
        for handle in list(self._open.values()):
            self.abort(handle)
        self._placement.drop_tier(tier)
        if tier is Tier.GPU:
            self.engine_generation += 1
            if self.host_writes is not None:
                self.host_writes.engine_lost()

    def invalidate(self, doc_id: str) -> int:
        """Drop every node of document `doc_id` (any content hash, any prefix) and their
        subtrees. Pinned nodes become unmatchable now and free their slots when unpinned.
        Returns the number of nodes removed."""
        if self.host_writes is not None:
            self.host_writes.forget(doc_id)
        return self._invalidate(self._prefixes.nodes_of(doc_id))

    def invalidate_loads(self, handle: RequestHandle, failed_spans: Sequence[int]) -> int:
        """The load spans `failed_spans` of `handle`'s plan failed: the nodes they read (at
        this request's prefix only) may hold bad bytes. Each leaves the tree with its subtree
        (a copy needs its parent's); a failed root leaves with everything below it, and the
        policy's clocks and frequencies stay. For open and finished handles alike; in-flight
        readers keep their pins. Returns the number of nodes removed."""
        hit_nodes = handle.ledger.path[: len(handle.hits.hits)]
        loaded = [node for node in hit_nodes if node.num_tokens]  # one load span each
        return self._invalidate([loaded[i] for i in failed_spans if i < len(loaded)])

    def invalidate_written(self, handle: RequestHandle) -> int:
        """Every copy `handle` wrote (its stores) may not have run: the nodes holding them leave
        the tree as in `invalidate_loads`. Returns the number of nodes removed."""
        return self._invalidate(list(dict.fromkeys(node for node, _ in handle.ledger.pending)))

    def clear(self) -> None:
        """Drop every node, reset the policy (clocks), the frequency window and the counters.
        In-flight requests stay valid: their pinned nodes are detached and freed when they
        finish."""
        self._placement.clear()
        if self.host_writes is not None:
            self.host_writes.forget()
        self.policy.reset()
        self._planner.reset()
        self._placement.reset_counters()
        if self.host_writes is not None:
            self.host_writes.reset_counters()

    @property
    def host_victim_slots(self) -> int:
        """Host slots lent to the engine as victims now (eviction-time host writes)."""
        return self._placement.victim_slots

    def check_integrity(self) -> None:
        """Verify every invariant of every part; raises `IntegrityError` naming the first
        violation. O(nodes + slots)."""
        self._prefixes.check()
        self._placement.check(OpenHoldings.of(self._open.values()))
        self._planner.check()
        if self.host_writes is not None:
            self.host_writes.check()
        for request_id, handle in self._open.items():
            if not handle.is_open or handle.request_id != request_id:
                fail(f"{handle!r} is registered as open request {request_id}")

    # ------------------------------------------------------------------ internals

    def _invalidate(self, nodes: list[Node]) -> int:
        """Remove `nodes` (those still attached) with their subtrees; a root leaves with its
        whole subtree (the policy's state is kept). Returns the number of document nodes
        removed."""
        before = self._prefixes.num_doc_nodes
        for node in nodes:
            if node.attached:
                self._placement.remove(node)
        return before - self._prefixes.num_doc_nodes

    def _finish(self, handle: RequestHandle, state: RequestState) -> None:
        self._placement.release(handle)
        if self.host_writes is not None:
            self.host_writes.end(handle)
        handle.state = state
        del self._open[handle.request_id]

    def _check_open(self, handle: RequestHandle) -> None:
        if handle.state is not RequestState.OPEN or handle.request_id not in self._open:
            raise RAGCacheError(f"request {handle.request_id} is already {handle.state}")
