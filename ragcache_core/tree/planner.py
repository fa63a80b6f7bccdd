"""The planner: one request's match, pins, statistics, evictions and plan (docs/design.md 3.2).

begin_request(root_key, root_tokens, docs, question_tokens, final)
  1. walk the forest's root of `root_key` -> docs[:max_depth]; the hit prefix is the
     leading nodes with a confirmed copy in a slot tier (the host tier)
  2. alpha = hit tokens (with eviction-time writes, and the nodes vLLM's blocks hold after
     them), beta = every other prompt token; pin the hits, touch every node on the path,
     record a cost sample on the nodes this request computes
  3. load the hit prefix (`_plan_hits`; vLLM's blocks serve what they hold first, and a
     host hit loaded into them becomes one of them); then the host tier's write rule: at
     compute, store the uncached tail on it (`_plan_stores`); at eviction, keep the path past
     the host's copies (`_plan_keeps`) and lend the host lease (`HostWrites`)
  4. plan = load, store or keep and lease
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ragcache_core.capacity import slots_for_tokens
from ragcache_core.cost import CostModel
from ragcache_core.errors import InputError
from ragcache_core.plan import HostLease, KeepSpan, LoadSpan, Plan, StoreSpan, Tier
from ragcache_core.policy import NodeStats
from ragcache_core.tree.host_writes import HostWrites
from ragcache_core.tree.integrity import fail
from ragcache_core.tree.keys import DocKey, DocSpec, RootKey
from ragcache_core.tree.node import Node
from ragcache_core.tree.placement import Placement
from ragcache_core.tree.prefix import PrefixTree, match_result, readable_prefix
from ragcache_core.tree.request import RequestHandle

STORE_POLICIES = ("always", "second", "no_evict")
SEEN_LIMIT = 1 << 16
"""Prefixes the "second" store policy remembers (a few MB at most)."""

Hits = list[tuple[Node, Tier]]
"""The hit prefix of a request: each node with the tier it is read from."""


class Planner:
    """Turns requests into plans over `tree` and `placement`, and keeps the access statistics
    the policy reads (the logical clock, final-request counts, the "second" policy's memory).

    Mutates the tree (new nodes), the placement (pins, copies, evictions), nodes' statistics
    and itself. Settings are described on `KnowledgeTree`. Every node a plan reads or writes
    is pinned by its request before the next `make_room`, so planning never evicts what the
    plan itself uses.
    """

    def __init__(
        self,
        prefixes: PrefixTree,
        placement: Placement,
        *,
        page_size: int,
        cost_model: CostModel,
        max_depth: int | None,
        frequency_window: int | None,
        store_policy: str,
        host_writes: HostWrites | None = None,
    ) -> None:
        self._prefixes = prefixes
        self._placement = placement
        self.page_size = page_size
        self.cost_model = cost_model
        self.max_depth = max_depth
        self.frequency_window = frequency_window
        self.store_policy = store_policy
        self.host_writes = host_writes
        """Eviction-time host writes (None: the host tier is written as documents are
        computed, by a plan's stores)."""
        self.now = 0
        """Logical time: requests begun so far (never reset: nodes' `last_access` use it)."""
        self.final_requests = 0
        """Final requests since `reset`; frequency windows count in them."""
        self._seen: OrderedDict[tuple[DocKey, ...], None] = OrderedDict()
        """Prefixes (document keys from the root) met but not stored ("second" policy),
        bounded by `SEEN_LIMIT` (the oldest are forgotten)."""

    def begin_request(
        self,
        request_id: int,
        root_key: RootKey,
        root_tokens: int,
        docs: Sequence[DocSpec],
        question_tokens: int,
        *,
        final: bool,
    ) -> RequestHandle:
        """Match, pin, evict and allocate for one request; return its handle with its plan.

        The caller registers the handle and later releases it (confirm or abort). Never fails
        for lack of room: without room the request stores fewer (or no) nodes. Raises
        `InputError` for negative sizes, a root size that differs from the cached root's or a
        document whose size differs from its cached node's; nothing is changed then.
        """
        cached_docs, path = self._match_path(root_key, root_tokens, docs, question_tokens)
        self.now += 1
        if final:
            self.final_requests += 1
        handle = RequestHandle(request_id, final=final, page_size=self.page_size)
        starts = _prompt_starts(root_tokens, docs)
        hits = readable_prefix(path)
        num_cached = len(hits)
        if self.host_writes is not None:  # then vLLM's blocks hold what follows, as last heard
            while num_cached < len(path) and path[num_cached].resident:
                num_cached += 1
        alpha = sum(node.num_tokens for node in path[:num_cached])
        beta = starts[-1] + question_tokens - alpha
        cost_per_new = self.cost_model.prefill_time(alpha, beta) / beta if beta > 0 else 0.0
        self._record_access(path, len(hits), num_cached, cost_per_new, handle)

        load = self._plan_hits(hits, starts)
        store: list[StoreSpan] = []
        keep: list[KeepSpan] = []
        lease: HostLease | None = None
        if self.host_writes is not None:
            # Every node past the host's copies is vLLM's alone (nothing is in flight here).
            keep = self._plan_keeps(
                path, len(hits), root_key, root_tokens, cached_docs, starts, cost_per_new, handle
            )
            lease = self.host_writes.lease_for(
                handle,
                may_evict=self.store_policy != "no_evict",
                allocating_slots=slots_for_tokens(
                    beta + sum(span.num_tokens for span in load), self.page_size
                ),
                keep_slots=tuple(slots_for_tokens(k.num_tokens, self.page_size) for k in keep),
            )
        elif len(hits) == len(path):  # an in-flight node blocks storing below it
            store = self._plan_stores(
                path, root_key, root_tokens, cached_docs, starts, cost_per_new, handle
            )

        handle.plan = Plan(
            page_size=self.page_size,
            load=tuple(load),
            store=tuple(store),
            keep=tuple(keep),
            lease=lease,
        )
        handle.hits = match_result(path, hits)
        handle.cached_tokens = alpha
        handle.computed_tokens = beta
        return handle

    def mark_final(self, handle: RequestHandle) -> None:
        """Count a speculative request's retrievals toward frequency now (no-op if final):
        its path's nodes, and with eviction-time writes the documents it computed past them
        (kept paths, whose statistics the shadows hold; attached as nodes at settle)."""
        if handle.final:
            return
        handle.final = True
        self.final_requests += 1
        counted = {id(node.stats) for node in handle.ledger.path}
        for node in handle.ledger.path:
            if node.attached:
                self._touch(node, True)
        for shadow in handle.ledger.keeps:
            if id(shadow.stats) in counted:  # a path node's, counted above
                continue
            counted.add(id(shadow.stats))
            shadow.stats.touch(
                self.now, count=True, window=self._window(), final=self.final_requests
            )
            kept = self.host_writes.node_of(shadow) if self.host_writes is not None else None
            if kept is not None:
                self._placement.refresh(kept)

    def reset(self) -> None:
        """Forget frequency windows and the "second" policy's memory (the clock stays)."""
        self.final_requests = 0
        self._seen.clear()

    def check(self) -> None:
        """The planner's own invariants. Raises `IntegrityError`."""
        if self.max_depth is not None:
            for node in self._prefixes.all_nodes():
                if node.depth > self.max_depth:
                    fail(f"{node!r} is deeper than max_depth={self.max_depth}")
        if len(self._seen) > SEEN_LIMIT:
            fail(f"the store policy remembers {len(self._seen)} prefixes (> {SEEN_LIMIT})")

    # ------------------------------------------------------------------ steps of begin_request

    def _match_path(
        self, root_key: RootKey, root_tokens: int, docs: Sequence[DocSpec], question_tokens: int
    ) -> tuple[Sequence[DocSpec], list[Node]]:
        """Validate the request; return the documents it may cache (`max_depth`) and the
        existing nodes along them. Does not modify anything."""
        if root_tokens < 0 or question_tokens < 0:
            raise InputError("root_tokens and question_tokens cannot be negative")
        root = self._prefixes.roots.get(root_key)
        if root is not None and root.slots and root.num_tokens != root_tokens:
            raise InputError(
                f"root has {root.num_tokens} cached tokens but the request says {root_tokens}: "
                "a different template/system prompt needs a different root key"
            )
        depth = len(docs) if self.max_depth is None else min(len(docs), self.max_depth)
        cached_docs = docs[:depth]
        path = self._prefixes.walk([d.key for d in cached_docs], root_key)
        for node, spec in zip(path[1:], cached_docs, strict=False):
            if node.num_tokens != spec.num_tokens:
                raise InputError(
                    f"document {spec.key.doc_id!r}: {spec.num_tokens} tokens, but the cached node "
                    f"of the same content hash has {node.num_tokens}"
                )
        return cached_docs, path

    def _record_access(
        self,
        path: list[Node],
        num_hits: int,
        num_cached: int,
        cost_per_new: float,
        handle: RequestHandle,
    ) -> None:
        """Pin the hits; touch every node on the path; the nodes past the first `num_cached`
        (the hits and the nodes vLLM's blocks hold after them) are in flight and this request
        recomputes them, so they get a cost sample."""
        placement = self._placement
        for node in path[:num_hits]:
            placement.pin(node, handle)
        for node in path[:num_cached]:
            self._touch(node, handle.final)
        for node in path[num_cached:]:
            node.stats.record_computed(cost_per_new)
            self._touch(node, handle.final)
        handle.ledger.path = list(path)

    @staticmethod
    def _plan_hits(hits: Hits, starts: list[int]) -> list[LoadSpan]:
        """One load span per hit node of tokens, from the tier it is read from (a host hit
        the connector loads into vLLM's blocks becomes one of them: it promotes itself)."""
        return [
            LoadSpan(tier, node.slots[tier], starts[index], node.num_tokens)
            for index, (node, tier) in enumerate(hits)
            if node.num_tokens
        ]

    def _plan_stores(
        self,
        path: list[Node],
        root_key: RootKey,
        root_tokens: int,
        cached_docs: Sequence[DocSpec],
        starts: list[int],
        cost_per_new: float,
        handle: RequestHandle,
    ) -> list[StoreSpan]:
        """Create host copies for the uncached tail (root first if absent), one node at a time
        while the store policy admits it and room can be made; stop at the first that does
        not fit (a node's copy needs its parent's)."""
        wanted: list[tuple[DocKey | RootKey, int, int]] = []
        if not path:
            wanted.append((root_key, root_tokens, 0))
        first = max(len(path) - 1, 0)
        for i in range(first, len(cached_docs)):
            wanted.append((cached_docs[i].key, cached_docs[i].num_tokens, starts[i + 1]))
        parent = path[-1] if path else None
        prefix = tuple(spec.key for spec in cached_docs[:first])
        store: list[StoreSpan] = []
        tier = Tier.HOST
        for key, num_tokens, start in wanted:
            if parent is not None and not self._placement.usable(parent, tier, handle):
                break  # a copy needs its parent's in the same tier, for sure (see usable)
            count = slots_for_tokens(num_tokens, self.page_size)
            if isinstance(key, DocKey):
                prefix = (*prefix, key)
                if not self._admit_store(prefix, count):
                    break
            if not self._placement.make_room(tier, count):
                break
            node, slots = self._store(key, parent, num_tokens, count, cost_per_new, handle)
            if num_tokens:
                store.append(StoreSpan(tier, slots, start, num_tokens))
            parent = node
        return store

    def _plan_keeps(
        self,
        path: list[Node],
        num_hits: int,
        root_key: RootKey,
        root_tokens: int,
        cached_docs: Sequence[DocSpec],
        starts: list[int],
        cost_per_new: float,
        handle: RequestHandle,
    ) -> list[KeepSpan]:
        """Keep spans (eviction-time host writes) for the path past the host-readable prefix
        (its first `num_hits` nodes), root first if it has no host copy, while the store policy
        admits them. Each is a shadow (`HostWrites.shadow`): a node on the path lends it its
        statistics (this access is recorded on them already); past the path the shadow records
        it. The shadows go on the handle: at its first token vLLM's blocks hold them
        (`HostWrites.settle`). A root of no tokens needs no copy: it is attached now."""
        assert self.host_writes is not None
        parent: int | None = None
        first = max(num_hits - 1, 0)
        wanted: list[tuple[int, tuple[DocKey, ...] | None, int, int]] = []
        if not num_hits:
            wanted.append((0, None, root_tokens, 0))
        prefix = tuple(spec.key for spec in cached_docs[:first])
        for i in range(first, len(cached_docs)):
            prefix = (*prefix, cached_docs[i].key)
            wanted.append((i + 1, prefix, cached_docs[i].num_tokens, starts[i + 1]))
        keep: list[KeepSpan] = []
        for position, docs, num_tokens, start in wanted:
            if docs is None and num_tokens == 0:
                root = self._prefixes.attach(root_key, None, 0, NodeStats(0, 0.0, self.now))
                self._placement.adopt_copy(root, Tier.HOST, ())
                continue
            if docs is not None and not self._admit_store(
                docs, slots_for_tokens(num_tokens, self.page_size)
            ):
                break
            node = path[position] if position < len(path) else None
            if node is not None:
                stats = node.stats
            else:
                standalone = (
                    self.cost_model.prefill_time(0, num_tokens) / num_tokens if num_tokens else 0.0
                )
                stats = NodeStats(num_tokens, standalone, self.now)
            shadow = self.host_writes.shadow(root_key, docs or (), num_tokens, stats)
            if node is not None:
                shadow.stats = node.stats  # one record of the path's statistics
            else:
                shadow.stats.record_computed(cost_per_new)
                shadow.stats.touch(
                    self.now, count=handle.final, window=self._window(), final=self.final_requests
                )
            handle.ledger.keeps.append(shadow)
            if num_tokens and (node is None or not node.resident):
                self.host_writes.computes(shadow, handle)
            if num_tokens:
                keep.append(KeepSpan(shadow.key, parent, start, num_tokens))
                parent = shadow.key
        return keep

    def _store(
        self,
        key: DocKey | RootKey,
        parent: Node | None,
        num_tokens: int,
        count: int,
        cost_per_new: float,
        handle: RequestHandle,
    ) -> tuple[Node, tuple[int, ...]]:
        """Attach a node below `parent` with a host copy this request writes and pins (room is
        made). Returns the node and its slots."""
        standalone = self.cost_model.prefill_time(0, num_tokens) / num_tokens if num_tokens else 0.0
        node = self._prefixes.attach(
            key, parent, num_tokens, NodeStats(num_tokens, standalone, self.now)
        )
        slots = self._placement.write_copy(node, Tier.HOST, count, handle)
        self._placement.pin(node, handle)
        handle.ledger.path.append(node)
        node.stats.record_computed(cost_per_new)
        self._touch(node, handle.final)
        if parent is None:
            handle.stored_root = True
        else:
            handle.stored_docs += 1
        return node, slots

    def _admit_store(self, prefix: tuple[DocKey, ...], count: int) -> bool:
        """Whether the store policy lets the document ending `prefix` be stored now."""
        if self.store_policy == "no_evict":
            return self._placement.available(Tier.HOST) >= count
        if self.store_policy == "second":
            if prefix in self._seen:
                del self._seen[prefix]
                return True
            self._seen[prefix] = None
            if len(self._seen) > SEEN_LIMIT:
                self._seen.popitem(last=False)
            return False
        return True

    def _touch(self, node: Node, count: bool) -> None:
        """An access to `node` now (`count`: a final request's, which bumps its frequency)."""
        node.stats.touch(self.now, count=count, window=self._window(), final=self.final_requests)
        self._placement.refresh(node)

    def _window(self) -> int:
        """The current frequency window's number."""
        if self.frequency_window is None:
            return 0
        return (self.final_requests - 1) // self.frequency_window


def _prompt_starts(root_tokens: int, docs: Sequence[DocSpec]) -> list[int]:
    """Token offsets of the root and each document in the prompt, then the question's."""
    starts = [0, root_tokens]
    for spec in docs:
        starts.append(starts[-1] + spec.num_tokens)
    return starts
