"""KnowledgeCache: the knowledge tree over two tiers, its policy, and the per-request planner.

The single source of truth of what is cached where (DESIGN.md 2.1-2.3, 3.2). Pure bookkeeping:
it decides and returns `Plan`s; the data plane copies the bytes.

Request lifecycle:

    handle = cache.begin_request(root_tokens, docs, question_tokens)  # match, pin, evict, plan
    ... connector executes handle.plan: swap_out, promote, load, (forward), store ...
    cache.confirm(handle)   # its stores ran: written copies become readable; unpin
    cache.abort(handle)     # or: the request died; its unconfirmed copies are dropped; unpin

Placement invariants (checked by `check_integrity`):
  * a node with a GPU copy has its parent on GPU; any node with a copy has a parent with a
    copy (never host-only below a freed parent);
  * eviction candidates of a tier are its unpinned leaves (no child with a copy in the tier);
  * swap out only once: the first GPU eviction of a node copies it to host, later ones just
    free the GPU copy; host eviction of a host-only node frees it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from ragcache_core.cost import CostModel, default_cost_model
from ragcache_core.errors import ConfigError, InputError, RAGCacheError
from ragcache_core.plan import LoadSpan, Plan, SlotCopy, StoreSpan, Tier
from ragcache_core.policy import NodeStats, make_policy
from ragcache_core.tree.capacity import slots_for_tokens, slots_in_tokens
from ragcache_core.tree.keys import DocKey, DocSpec, RootKey
from ragcache_core.tree.node import Node
from ragcache_core.tree.pool import TierPool
from ragcache_core.tree.request import RequestHandle, RequestState
from ragcache_core.tree.results import CacheStats, MatchResult, TierHit

STORE_POLICIES = ("always", "second", "no_evict")
SEEN_LIMIT = 1 << 16
"""Prefixes the "second" store policy remembers (a few MB at most)."""


class KnowledgeCache:
    """Knowledge tree + GPU/host slot pools + replacement policy, for one root key.

    Not thread-safe: the controller calls it from one thread (or one event loop).
    `max_depth` caches only the first j documents of a sequence (paper 2.7; None: all).
    `frequency_window` restarts PGDSF/GDSF/LFU frequencies every that many final requests
    (None: frequencies last until `clear()`).
    `backup_root` keeps a host copy of the root beside its GPU copy (paper 2.6).
    `store_policy` decides which computed documents are stored: "always" (the paper), "second"
    (only a document met before at the same prefix: one-off documents never cost a store or
    an eviction) or "no_evict" (only while free room is left: stores never evict).
    """

    def __init__(
        self,
        root_key: RootKey,
        *,
        gpu_slots: int,
        host_slots: int,
        page_size: int,
        policy: str = "pgdsf",
        cost_model: CostModel | None = None,
        max_depth: int | None = None,
        frequency_window: int | None = None,
        backup_root: bool = False,
        store_policy: str = "always",
    ) -> None:
        if max_depth is not None and max_depth < 0:
            raise ConfigError(f"max_depth cannot be negative, got {max_depth}")
        if frequency_window is not None and frequency_window <= 0:
            raise ConfigError(f"frequency_window must be positive, got {frequency_window}")
        if store_policy not in STORE_POLICIES:
            raise ConfigError(
                f"unknown store_policy {store_policy!r}; choose one of {', '.join(STORE_POLICIES)}"
            )
        self.store_policy = store_policy
        self._seen: OrderedDict[tuple[DocKey, ...], None] = OrderedDict()
        """Prefixes (document keys from the root) met but not stored ("second" policy),
        bounded by `SEEN_LIMIT` (the oldest are forgotten)."""
        self.root_key = root_key
        self.page_size = page_size
        self.max_depth = max_depth
        self.frequency_window = frequency_window
        self.backup_root = backup_root
        self.policy = make_policy(policy)
        self.cost_model: CostModel = cost_model or default_cost_model()
        self._pools = {
            Tier.GPU: TierPool(Tier.GPU, gpu_slots, page_size),
            Tier.HOST: TierPool(Tier.HOST, host_slots, page_size),
        }
        self._now = 0
        self._final_requests = 0
        self._next_request_id = 0
        self._open: dict[int, RequestHandle] = {}
        self._detached_pinned: set[Node] = set()
        self._doc_index: dict[str, set[Node]] = {}
        self._num_doc_nodes = 0
        self._root = self._new_root()

    @classmethod
    def from_tokens(
        cls,
        root_key: RootKey,
        *,
        gpu_tokens: int,
        host_tokens: int,
        page_size: int,
        **kwargs: object,
    ) -> KnowledgeCache:
        """Capacities in tokens (rounded down to whole slots of `page_size` tokens)."""
        return cls(
            root_key,
            gpu_slots=slots_in_tokens(gpu_tokens, page_size),
            host_slots=slots_in_tokens(host_tokens, page_size),
            page_size=page_size,
            **kwargs,  # type: ignore[arg-type]
        )

    # ------------------------------------------------------------------ queries (no mutation)

    def match(self, docs: Sequence[DocKey | DocSpec]) -> MatchResult:
        """The readable cached prefix of `docs` (root first). Does not modify the cache. O(h)."""
        keys = [d.key if isinstance(d, DocSpec) else d for d in docs]
        path = self._walk(keys)
        hits: list[TierHit] = []
        for node in path:
            tier = node.readable_tier()
            if tier is None:
                break
            hits.append(TierHit(node.key, node.num_tokens, tier))
        return MatchResult(hits=tuple(hits), in_flight=len(path) - len(hits))

    def cached_tokens(self, docs: Sequence[DocSpec]) -> int:
        """`match(docs).cached_tokens` without building the result (the reordering queue's
        hot path). Does not modify the cache. O(h)."""
        node = self._root
        if not node.ready:
            return 0
        total = node.num_tokens
        for spec in docs:
            child = node.children.get(spec.key)
            if child is None or not child.ready:
                break
            total += child.num_tokens
            node = child
        return total

    @property
    def num_nodes(self) -> int:
        """Nodes holding a copy (ready or in flight), the root included."""
        return self._num_doc_nodes + (1 if self._root.slots else 0)

    def stats(self) -> CacheStats:
        gpu, host = self._pools[Tier.GPU].allocator, self._pools[Tier.HOST].allocator
        return CacheStats(
            nodes=self.num_nodes,
            gpu_slots=gpu.num_slots,
            gpu_used_slots=gpu.num_used,
            host_slots=host.num_slots,
            host_used_slots=host.num_used,
            pinned_nodes=sum(1 for n in self.iter_nodes() if n.pins) + len(self._detached_pinned),
            open_requests=len(self._open),
            page_size=self.page_size,
        )

    def iter_nodes(self) -> Iterator[Node]:
        """Every attached node that holds a copy, parents before children (for checks/tests)."""
        if not self._root.slots:
            return
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ request lifecycle

    def begin_request(
        self,
        root_tokens: int,
        docs: Sequence[DocSpec],
        question_tokens: int,
        *,
        final: bool = True,
    ) -> RequestHandle:
        """Match, pin, evict and allocate for one request; return its handle and plan.

        Mutates the tree, the pools and the policy state. The caller must later call exactly
        one of `confirm(handle)` or `abort(handle)`. Never fails for lack of room: without room
        the request stores fewer (or no) nodes. Raises `InputError` for negative sizes or a
        root size that differs from the cached root's.
        """
        if root_tokens < 0 or question_tokens < 0:
            raise InputError("root_tokens and question_tokens cannot be negative")
        root = self._root
        if root.slots and root.num_tokens != root_tokens:
            raise InputError(
                f"root has {root.num_tokens} cached tokens but the request says {root_tokens}: "
                "a different template/system prompt needs a different root key"
            )
        self._now += 1
        if final:
            self._final_requests += 1
        handle = RequestHandle(self._next_request_id, final=final, page_size=self.page_size)
        self._next_request_id += 1
        self._open[handle.request_id] = handle

        depth = len(docs) if self.max_depth is None else min(len(docs), self.max_depth)
        cached_docs = docs[:depth]
        path = self._walk([d.key for d in cached_docs])
        for node, spec in zip(path[1:], cached_docs, strict=False):
            if node.num_tokens != spec.num_tokens:
                raise InputError(
                    f"document {spec.key.doc_id!r}: {spec.num_tokens} tokens, but the cached node "
                    f"of the same content hash has {node.num_tokens}"
                )
        # Token offsets of the root and each document in the prompt.
        starts = [0, root_tokens]
        for spec in docs:
            starts.append(starts[-1] + spec.num_tokens)

        hits: list[tuple[Node, Tier]] = []
        for node in path:
            tier = node.readable_tier()
            if tier is None:
                break
            hits.append((node, tier))
        alpha = sum(node.num_tokens for node, _ in hits)
        beta = starts[-1] + question_tokens - alpha
        cost_per_new = self.cost_model.prefill_time(alpha, beta) / beta if beta > 0 else 0.0

        for node, _ in hits:
            self._pin(node, handle)
            self._touch(node, final)
        for node in path[len(hits) :]:  # in flight: recomputed by this request too
            node.stats.record_computed(cost_per_new)
            self._touch(node, final)
        handle._path = list(path)

        promote, load = self._plan_hits(hits, starts, handle)
        if self.backup_root:
            self._plan_root_backup(hits, handle)
        store: list[StoreSpan] = []
        if len(hits) == len(path):  # an in-flight node blocks storing below it
            store = self._plan_stores(path, root_tokens, cached_docs, starts, cost_per_new, handle)

        handle.plan = Plan(
            page_size=self.page_size,
            swap_out=tuple(handle._swap_out),
            promote=tuple(promote),
            load=tuple(load),
            store=tuple(store),
        )
        handle.hits = MatchResult(
            hits=tuple(TierHit(n.key, n.num_tokens, t) for n, t in hits),
            in_flight=len(path) - len(hits),
        )
        handle.cached_tokens = alpha
        handle.computed_tokens = beta
        for pool in self._pools.values():
            pool.maybe_compact(self.num_nodes)
        return handle

    def confirm(self, handle: RequestHandle) -> None:
        """The request's copies are known to be complete (the controller confirms when the
        request finishes and the connector reports its stores ran; after the first token would
        also be safe): copies it wrote become readable; release its pins
        and held slots. Raises `RAGCacheError` if the handle is not open."""
        self._check_open(handle)
        for node, tier in handle._pending:
            if node.attached and tier in node.slots:
                node.ready.add(tier)
        self._finish(handle, RequestState.CONFIRMED)

    def abort(self, handle: RequestHandle) -> None:
        """The request failed or was aborted after the engine stopped executing it: drop every
        copy it was writing (nodes left without a copy leave the tree with their subtrees),
        release pins and held slots. Raises `RAGCacheError` if the handle is not open."""
        self._check_open(handle)
        for node, tier in reversed(handle._pending):
            if tier not in node.slots:
                continue
            self._drop_copy(node, tier)
            if node.attached and not node.slots:
                self._remove(node)
        self._finish(handle, RequestState.ABORTED)

    def mark_final(self, handle: RequestHandle) -> None:
        """A speculative request turned out to use the final documents: count its retrievals
        toward frequency now. No-op for a request that was final already."""
        if handle.final:
            return
        handle.final = True
        self._final_requests += 1
        for node in handle._path:
            if node.attached:
                self._touch(node, True)

    # ------------------------------------------------------------------ maintenance

    def drop_tier(self, tier: Tier) -> None:
        """Every copy in `tier` is gone (e.g. the GPU worker died). Aborts every open request
        first; nodes keeping a confirmed copy elsewhere survive, the rest leave the tree."""
        for handle in list(self._open.values()):
            self.abort(handle)
        stack = [self._root]
        while stack:
            node = stack.pop()
            if tier in node.slots:
                self._drop_copy(node, tier)
            if node.slots:
                stack.extend(node.children.values())
            else:
                self._remove(node)

    def invalidate(self, doc_id: str) -> int:
        """Drop every node of document `doc_id` (any content hash, any prefix) and their
        subtrees. Pinned nodes become unmatchable now and free their slots when unpinned.
        Returns the number of nodes removed."""
        before = self._num_doc_nodes
        for node in list(self._doc_index.get(doc_id, ())):
            if node.attached:
                self._remove(node)
        return before - self._num_doc_nodes

    def invalidate_loads(self, handle: RequestHandle, failed_spans: Sequence[int]) -> int:
        """The load spans `failed_spans` of `handle`'s plan failed: the nodes they read (at
        this request's prefix only) may hold bad bytes. Each leaves the tree with its subtree
        (a copy needs its parent's); a failed root empties the tree but keeps the policy's
        clocks and frequencies. For open and finished handles alike; in-flight readers keep
        their pins. Returns the number of nodes removed."""
        hit_nodes = handle._path[: len(handle.hits.hits)]
        loaded = [node for node in hit_nodes if node.num_tokens]
        return self._invalidate([loaded[i] for i in failed_spans if i < len(loaded)])

    def invalidate_written(self, handle: RequestHandle) -> int:
        """Every copy `handle` wrote (stores, swap-outs, promotions) may not have run: the
        nodes holding them leave the tree as in `invalidate_loads`. Returns the number of
        nodes removed."""
        return self._invalidate(list(dict.fromkeys(node for node, _ in handle._pending)))

    def _invalidate(self, nodes: list[Node]) -> int:
        before = self._num_doc_nodes
        for node in nodes:
            if node is self._root:
                self._replace_root()
            elif node.attached:
                self._remove(node)
        return before - self._num_doc_nodes

    def clear(self) -> None:
        """Drop every node, reset the policy (clocks) and the frequency window. In-flight
        requests stay valid: their pinned nodes are detached and freed when they finish."""
        self._replace_root()
        self.policy.reset()
        self._final_requests = 0
        self._seen.clear()

    def _replace_root(self) -> None:
        """Detach the root and everything below it (pinned nodes are freed when unpinned) and
        start an empty tree; the policy's state is kept."""
        old = self._root
        for child in list(old.children.values()):
            self._remove(child)
        old.attached = False
        if old.pins:
            self._detached_pinned.add(old)
        else:
            for tier in list(old.slots):
                self._release_copy(old, tier)
        self._root = self._new_root()
        for pool in self._pools.values():
            pool.clear_heap()

    def check_integrity(self) -> None:
        """Verify every invariant; raises `IntegrityError` naming the first violation."""
        from ragcache_core.tree.integrity import check_integrity

        check_integrity(self)

    # ------------------------------------------------------------------ planning helpers

    def _plan_hits(
        self, hits: list[tuple[Node, Tier]], starts: list[int], handle: RequestHandle
    ) -> tuple[list[SlotCopy], list[LoadSpan]]:
        """Load spans for the hit prefix; promote host hits to GPU while room can be made."""
        promote: list[SlotCopy] = []
        load: list[LoadSpan] = []
        promoting = True
        for index, (node, tier) in enumerate(hits):
            source = tier
            if tier is Tier.HOST and Tier.GPU not in node.slots and promoting:
                parent_on_gpu = node.parent is None or self._gpu_usable(node.parent, handle)
                count = len(node.slots[Tier.HOST])
                if parent_on_gpu and self._make_room(Tier.GPU, count, handle):
                    gpu_slots = self._allocate(Tier.GPU, count, handle)
                    promote.append(SlotCopy(node.slots[Tier.HOST], gpu_slots))
                    self._add_copy(node, Tier.GPU, gpu_slots)
                    handle._pending.append((node, Tier.GPU))
                    self._refresh(node)
                    source = Tier.GPU
                else:
                    promoting = False  # children cannot go above a parent left on host
            if node.num_tokens:
                load.append(LoadSpan(source, node.slots[source], starts[index], node.num_tokens))
        return promote, load

    def _plan_root_backup(self, hits: list[tuple[Node, Tier]], handle: RequestHandle) -> None:
        """Keep a host copy of the root (the system prompt) beside its GPU copy (paper 2.6):
        the host pool outlives a GPU worker, so after a worker failure the most shared node
        is still cached. Copied by the plan's swap_out step; readable once this request
        confirms. Skipped when the host tier has no room."""
        if not hits or hits[0][0] is not self._root:
            return
        root = self._root
        if Tier.HOST in root.slots or Tier.GPU not in root.ready or not root.num_tokens:
            return
        count = len(root.slots[Tier.GPU])
        if not self._make_room(Tier.HOST, count, handle):
            return
        host_slots = self._allocate(Tier.HOST, count, handle)
        self._add_copy(root, Tier.HOST, host_slots)
        handle._pending.append((root, Tier.HOST))
        handle._swap_out.append(SlotCopy(root.slots[Tier.GPU], host_slots))
        root.priority[Tier.HOST] = self.policy.priority(root.stats, Tier.HOST)

    def _plan_stores(
        self,
        path: list[Node],
        root_tokens: int,
        cached_docs: Sequence[DocSpec],
        starts: list[int],
        cost_per_new: float,
        handle: RequestHandle,
    ) -> list[StoreSpan]:
        """Create GPU copies for the uncached tail (root first if absent), while room allows."""
        wanted: list[tuple[DocKey | RootKey, int, int]] = []
        if not path:
            wanted.append((self.root_key, root_tokens, 0))
        first = max(len(path) - 1, 0)
        for i in range(first, len(cached_docs)):
            wanted.append((cached_docs[i].key, cached_docs[i].num_tokens, starts[i + 1]))
        parent = path[-1] if path else None
        prefix = tuple(spec.key for spec in cached_docs[:first])
        store: list[StoreSpan] = []
        for key, num_tokens, start in wanted:
            if parent is not None and not self._gpu_usable(parent, handle):
                break  # a GPU copy needs its parent on GPU, for sure (see _gpu_usable)
            count = slots_for_tokens(num_tokens, self.page_size)
            if isinstance(key, DocKey):
                prefix = (*prefix, key)
                if not self._admit_store(prefix, count, handle):
                    break
            if not self._make_room(Tier.GPU, count, handle):
                break
            node = self._attach(key, parent, num_tokens)
            slots = self._allocate(Tier.GPU, count, handle)
            self._add_copy(node, Tier.GPU, slots)
            self._pin(node, handle)
            handle._pending.append((node, Tier.GPU))
            handle._path.append(node)
            node.stats.record_computed(cost_per_new)
            self._touch(node, handle.final)
            if parent is None:
                handle.stored_root = True
            else:
                handle.stored_docs += 1
            if num_tokens:
                store.append(StoreSpan(slots, start, num_tokens))
            parent = node
        return store

    def _admit_store(self, prefix: tuple[DocKey, ...], count: int, handle: RequestHandle) -> bool:
        """Whether the store policy lets the document ending `prefix` be stored now."""
        if self.store_policy == "no_evict":
            held = len(handle._reusable_gpu)
            return self._pools[Tier.GPU].allocator.num_free + held >= count
        if self.store_policy == "second":
            if prefix in self._seen:
                del self._seen[prefix]
                return True
            self._seen[prefix] = None
            if len(self._seen) > SEEN_LIMIT:
                self._seen.popitem(last=False)
            return False
        return True

    # ------------------------------------------------------------------ eviction

    def _make_room(self, tier: Tier, count: int, handle: RequestHandle) -> bool:
        """Evict from `tier` until `count` slots are available to `handle`. Returns False
        (having evicted what it could) if pinned nodes leave too little room."""
        pool = self._pools[tier]

        def available() -> int:
            held = len(handle._reusable_gpu) if tier is Tier.GPU else 0
            return pool.allocator.num_free + held

        if available() >= count:
            return True
        if available() + pool.evictable_bound() < count:
            return False
        while available() < count:
            victim = pool.pop_victim()
            if victim is None:
                return False
            self._evict(victim, tier, handle)
        return True

    def _evict(self, node: Node, tier: Tier, handle: RequestHandle) -> None:
        """Evict candidate `node` from `tier` (its lowest-priority unpinned leaf)."""
        self.policy.on_evict(tier, node.priority[tier])
        if tier is Tier.HOST or Tier.HOST in node.slots:
            # Host eviction, or a GPU eviction of a node already on host (zero copy).
            self._drop_copy(node, tier)
            if not node.slots:
                self._remove(node)
            return
        gpu_slots = node.slots[Tier.GPU]
        if self._make_room(Tier.HOST, len(gpu_slots), handle):
            # First GPU eviction: swap out once. The GPU slots stay reserved for this request
            # (its plan copies them out before anything overwrites them).
            host_slots = self._allocate(Tier.HOST, len(gpu_slots), handle)
            self._drop_copy(node, Tier.GPU, hold_for=handle)
            self._add_copy(node, Tier.HOST, host_slots)
            self._pin(node, handle)
            handle._pending.append((node, Tier.HOST))
            handle._swap_out.append(SlotCopy(gpu_slots, host_slots))
            node.priority[Tier.HOST] = self.policy.priority(node.stats, Tier.HOST)
        else:
            self._drop_copy(node, Tier.GPU)
            self._remove(node)

    # ------------------------------------------------------------------ node bookkeeping

    def _new_root(self) -> Node:
        return Node(self.root_key, None, 0, NodeStats(0, 0.0, self._now))

    def _walk(self, keys: Sequence[DocKey]) -> list[Node]:
        """Existing nodes along root, keys[0], keys[1], ... (stops at the first absent one)."""
        node = self._root
        if not node.slots:
            return []
        path = [node]
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    @staticmethod
    def _gpu_usable(node: Node, handle: RequestHandle) -> bool:
        """May `handle` put a GPU copy below `node`? Only if node's GPU copy is confirmed or
        written by `handle` itself: another request's unconfirmed copy may still be aborted,
        which would leave the new copy on GPU below a parent that is not."""
        return Tier.GPU in node.ready or (node, Tier.GPU) in handle._pending

    def _attach(self, key: DocKey | RootKey, parent: Node | None, num_tokens: int) -> Node:
        standalone = self.cost_model.prefill_time(0, num_tokens) / num_tokens if num_tokens else 0.0
        if parent is None:  # the root: reuse the node object, (re)set its size and stats
            node = self._root
            node.num_tokens = num_tokens
            node.stats = NodeStats(num_tokens, standalone, self._now)
        else:
            assert isinstance(key, DocKey)
            node = Node(key, parent, num_tokens, NodeStats(num_tokens, standalone, self._now))
            parent.children[key] = node
            self._doc_index.setdefault(key.doc_id, set()).add(node)
            self._num_doc_nodes += 1
        return node

    def _remove(self, top: Node) -> None:
        """Remove `top` and its subtree from the tree (a node without a copy cannot stay, nor
        can anything below it). Unpinned copies are freed now; a pinned node keeps its slots,
        detached and unmatchable, until its last pin is released. The root object stays in
        place, emptied."""
        if top is self._root:
            for child in list(top.children.values()):
                self._remove(child)
            for tier in list(top.slots):
                self._drop_copy(top, tier)
            return
        parent = top.parent
        assert parent is not None and top.attached
        for tier in top.slots:
            self._child_left_tier(parent, tier)
        del parent.children[top.key]  # type: ignore[arg-type]
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.attached = False
            self._num_doc_nodes -= 1
            self._unindex(node)
            if node.pins:
                self._detached_pinned.add(node)
            else:
                for tier in list(node.slots):
                    self._release_copy(node, tier)

    def _unindex(self, node: Node) -> None:
        if isinstance(node.key, DocKey):
            nodes = self._doc_index.get(node.key.doc_id)
            if nodes is not None:
                nodes.discard(node)
                if not nodes:
                    del self._doc_index[node.key.doc_id]

    def _release_copy(self, node: Node, tier: Tier) -> None:
        """Free a removed node's copy now if unpinned; a pinned node keeps it until unpinned."""
        if node.pins:
            return
        pool = self._pools[tier]
        pool.allocator.free(node.slots.pop(tier))
        node.ready.discard(tier)

    def _add_copy(self, node: Node, tier: Tier, slots: tuple[int, ...]) -> None:
        node.slots[tier] = slots
        if node.parent is not None:
            node.parent.tier_children[tier] += 1
        if node.pins:
            self._pools[tier].pinned_slots += len(slots)

    def _drop_copy(self, node: Node, tier: Tier, hold_for: RequestHandle | None = None) -> None:
        """Remove `node`'s copy in `tier`; its slots go back to the allocator, or to
        `hold_for`'s reusable list when a pending plan still reads them."""
        pool = self._pools[tier]
        slots = node.slots.pop(tier)
        node.ready.discard(tier)
        if node.pins:
            pool.pinned_slots -= len(slots)
        if hold_for is not None:
            hold_for._reusable_gpu.extend(slots)
            pool.quarantined += len(slots)
        else:
            pool.allocator.free(slots)
        if node.parent is not None and node.attached:
            self._child_left_tier(node.parent, tier)

    def _child_left_tier(self, parent: Node, tier: Tier) -> None:
        parent.tier_children[tier] -= 1
        if parent.tier_children[tier] == 0 and tier in parent.slots:
            self._pools[tier].push(parent)

    def _allocate(self, tier: Tier, count: int, handle: RequestHandle) -> tuple[int, ...]:
        if tier is Tier.GPU and handle._reusable_gpu:
            take = min(count, len(handle._reusable_gpu))
            reused = handle._reusable_gpu[len(handle._reusable_gpu) - take :]
            del handle._reusable_gpu[len(handle._reusable_gpu) - take :]
            self._pools[tier].quarantined -= take
            return tuple(reused) + self._pools[tier].allocator.allocate(count - take)
        return self._pools[tier].allocator.allocate(count)

    def _pin(self, node: Node, handle: RequestHandle) -> None:
        if node.pins == 0:
            for tier, slots in node.slots.items():
                self._pools[tier].pinned_slots += len(slots)
        node.pins += 1
        handle._pins.append(node)

    def _unpin(self, node: Node) -> None:
        node.pins -= 1
        if node.pins:
            return
        for tier, slots in node.slots.items():
            self._pools[tier].pinned_slots -= len(slots)
        if not node.attached:
            self._detached_pinned.discard(node)
            for tier in list(node.slots):
                self._release_copy(node, tier)
            return
        for tier in node.slots:
            self._pools[tier].push(node)

    def _touch(self, node: Node, count: bool) -> None:
        window = (
            0
            if self.frequency_window is None
            else (self._final_requests - 1) // self.frequency_window
        )
        node.stats.touch(self._now, count=count, window=window)
        self._refresh(node)

    def _refresh(self, node: Node) -> None:
        for tier in node.slots:
            node.priority[tier] = self.policy.priority(node.stats, tier)
            self._pools[tier].push(node)

    def _finish(self, handle: RequestHandle, state: RequestState) -> None:
        gpu = self._pools[Tier.GPU]
        gpu.allocator.free(handle._reusable_gpu)
        gpu.quarantined -= len(handle._reusable_gpu)
        handle._reusable_gpu = []
        for node in handle._pins:
            self._unpin(node)
        handle._pins = []
        handle.state = state
        del self._open[handle.request_id]

    def _check_open(self, handle: RequestHandle) -> None:
        if handle.state is not RequestState.OPEN or handle.request_id not in self._open:
            raise RAGCacheError(f"request {handle.request_id} is already {handle.state}")
