"""One engine, simulated: vLLM's prefix-cached blocks under LRU, the host tier, and the time
each request takes (`ragcache simulate`; docs/control-plane.md, "The simulator").

  * vLLM's blocks (`sim.blocks.BlockPool`): a request hits the longest run of cached full
    blocks of its prompt (at most `prompt - 1` tokens), takes new blocks from the head of the
    free queue (evicting their hashes), caches each block once full, and at its end frees its
    blocks in reverse order (cached ones to the tail). `prefix_caching=False` is vLLM without
    it: no block is ever a hit;
  * the slot tiers below them are the engine's own `KnowledgeTree`, driven through the
    runtime's own `Lifecycle`: `open` plans the request (and checks the plan as the connector
    would), `first_token` confirms it, `settle` applies the connector's report (a
    `ConnectorResult` built as the scheduler side builds it); what the request read is counted
    by the runtime's `served_hits`. The policy (DGDSF, ...) and `store_policy` decide host
    admission and host eviction there as in the engine;
  * with `host_write="eviction"`, the engine's own `EvictionWindow` runs over the block pool
    every step: it copies a kept document when the pool hands one of its blocks out (and, with
    a look-ahead, as its blocks reach the head of the free queue, handing them back at the
    head or the tail: `host_write_return`); every copy succeeds.

Requests run one at a time, in order (the engine overlaps a few: its hit rate can differ). A
request's steps are vLLM's: its prefill in chunks of `max_num_batched_tokens`, then one step
per answer token after the first (`max_tokens - 1`); the window runs once a step. The engine's
order at a request's last step is kept: the request's keeps are recorded, the window's changes
since the previous report are taken, its blocks are freed, and then the step's copies are
handed back.

Time (`Served`): the prefill computes T(cached, computed) of the cost model; the host loads
before it and the copies on its steps' critical path (copies at hand-out and look-ahead in its
prefill steps, write-through stores) take bytes / the copy bandwidth (`CopyCost`); copies in
its decode steps keep the engine busy after its first token. Decoding itself is not timed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ragcache_core.capacity import slots_in_tokens
from ragcache_core.cost import CopyCost, CostModel, default_cost_model
from ragcache_core.engine.connector.report import ConnectorResult
from ragcache_core.engine.connector.window import EvictionWindow, HostWrite
from ragcache_core.errors import ConfigError
from ragcache_core.plan import NO_LOSSES, LoadSpan, Plan
from ragcache_core.policy import DEFAULT_POLICY
from ragcache_core.runtime.lifecycle import Lifecycle, served_hits
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.sim.blocks import Block, BlockHasher, BlockPool, Segment, TokenIds
from ragcache_core.trace import TraceRequest
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RootKey

ENGINE_ROOT = RootKey(model="sim", tokenizer="sim", template="sim", kv_dtype="sim")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's settings that decide its hits. `vllm_blocks`: vLLM's KV cache in blocks
    of `block_size` tokens (its null block included); `prefix_caching`: vLLM's (False: no
    block is ever a hit, as `vllm` without it); `host_tokens`: the host pool, in slots of
    `page_size` tokens; `window_tokens`: the eviction window's look-ahead (0, the engine's
    default: copies at hand-out only); `handout`: copies at hand-out (False: the look-ahead
    alone, as vLLM's lazy offload); the host lease's budget part is `max_num_batched_tokens`;
    `max_tokens`: answer tokens;
    `lease_victims`: the lease is topped up with victims (`CacheConfig.host_lease_victims`)."""

    vllm_blocks: int
    host_tokens: int
    block_size: int = 32
    page_size: int = 16
    policy: str = DEFAULT_POLICY
    store_policy: str = "always"
    host_write: str = "compute"
    host_write_return: str = "head"
    max_num_batched_tokens: int = 4096
    window_tokens: int = 0
    handout: bool = True
    max_tokens: int = 8
    max_depth: int | None = None
    lease_victims: bool = True
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.host_write not in ("compute", "eviction"):
            raise ConfigError(f"unknown host_write {self.host_write!r}; choose compute or eviction")
        if self.host_write_return not in ("head", "tail"):
            raise ConfigError(
                f"unknown host_write_return {self.host_write_return!r}; choose head or tail"
            )
        if self.host_write == "eviction" and self.host_tokens <= 0:
            raise ConfigError("host_write='eviction' writes the host tier; host_tokens is 0")
        if self.host_write == "eviction" and not self.prefix_caching:
            raise ConfigError("host_write='eviction' copies what leaves vLLM's prefix cache")
        if self.max_tokens < 1 or self.max_num_batched_tokens < 1 or self.host_tokens < 0:
            raise ConfigError("max_tokens and max_num_batched_tokens must be positive")


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One prompt: root (template and system prompt) tokens, documents, question tokens.
    `question` names the question's tokens (the same value: the same tokens, so a repeated
    request can hit its question and answer blocks in vLLM's cache); a `TokenIds` gives the
    ids themselves (a replay's), so the prompt's fixed text after the documents is shared."""

    root_tokens: int
    docs: tuple[DocSpec, ...]
    question_tokens: int
    question: Hashable

    @classmethod
    def from_trace(cls, request: TraceRequest, system_tokens: int) -> EngineRequest:
        """A trace request as `ragcache simulate` serves it (`trace_specs`' keys); its id
        names the question's tokens."""
        return cls(system_tokens, trace_specs(request), request.question_tokens, request.id)

    def prompt(self, docs: tuple[DocSpec, ...] | None = None) -> BuiltPrompt:
        """The request as the runtime's `Lifecycle` takes it, with `docs` (default: its own,
        in retrieval order) in that order. Only the pieces' lengths are read (the tree and the
        connector's checks count tokens), so the ids are zeros."""
        docs = self.docs if docs is None else docs
        return BuiltPrompt(
            root_ids=(0,) * self.root_tokens,
            doc_ids=tuple((0,) * spec.num_tokens for spec in docs),
            question_ids=(0,) * self.question_tokens,
            doc_specs=docs,
        )


def trace_specs(request: TraceRequest) -> tuple[DocSpec, ...]:
    """A trace request's documents as the tree's specs. The trace has no content hashes; the
    token count stands in (same id, same text)."""
    return tuple(
        DocSpec(DocKey(doc, str(n)), n)
        for doc, n in zip(request.docs, request.doc_tokens, strict=True)
    )


@dataclass(frozen=True, slots=True)
class Served:
    """What one request read: tokens vLLM had (`gpu_tokens`), tokens loaded from the host
    tier, and its documents' share of them (per document as the runtime counts them,
    `served_hits`); and its time: `prefill_s` (T(cached, computed)), `load_s` (its host
    loads), `copy_s` (copies on its prefill steps' critical path), `after_s` (copies in its
    decode steps: after its first token)."""

    prompt_tokens: int
    gpu_tokens: int
    loaded_tokens: int
    doc_tokens: int
    cached_doc_tokens: int
    docs: int
    gpu_docs: int
    host_docs: int
    prefill_s: float = 0.0
    load_s: float = 0.0
    copy_s: float = 0.0
    after_s: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return self.gpu_tokens + self.loaded_tokens

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def first_token_s(self) -> float:
        """From the start of its prefill to its first token."""
        return self.load_s + self.copy_s + self.prefill_s


@dataclass(frozen=True, slots=True)
class EngineResult:
    """Totals over the requests counted (a replay's measured ones). `token_hit_rate`: cached
    prompt tokens / prompt tokens (the root included, as `bench serve` counts);
    `doc_token_hit_rate`: cached document tokens / document tokens."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    doc_tokens: int
    cached_doc_tokens: int
    token_hit_rate: float
    doc_token_hit_rate: float
    doc_hit_rate: float
    gpu_doc_hit_rate: float
    host_doc_hit_rate: float
    host_slots_written: int
    vllm_block_evictions: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class EngineSimulator:
    """vLLM's block pool, the host tree (through its `Lifecycle`) and, with eviction-time
    writes, the window, across `serve` calls. `cost_model`: T(cached, computed), also the
    policy's; `copies`: the copy bandwidth (default: copies take no time)."""

    def __init__(
        self,
        config: EngineConfig,
        cost_model: CostModel | None = None,
        copies: CopyCost | None = None,
    ) -> None:
        self.config = config
        self.cost_model: CostModel = cost_model or default_cost_model()
        self.copies = copies or CopyCost()
        eviction = config.host_write == "eviction"
        self.lifecycle = Lifecycle.of(
            KnowledgeTree(
                ENGINE_ROOT,
                host_slots=slots_in_tokens(config.host_tokens, config.page_size),
                page_size=config.page_size,
                policy=config.policy,
                cost_model=self.cost_model,
                max_depth=config.max_depth,
                store_policy=config.store_policy,
                block_size=config.block_size,
                host_write=config.host_write,
                host_lease_slots=-(-config.max_num_batched_tokens // config.page_size)
                if eviction
                else 0,
                host_lease_victims=config.lease_victims,
            )
        )
        self.pool = BlockPool(config.vllm_blocks)
        self.hasher = BlockHasher(config.block_size)
        self.window = (
            EvictionWindow(
                window_blocks=-(-config.window_tokens // config.block_size),
                block_size=config.block_size,
                page_size=config.page_size,
                back_to_head=config.host_write_return == "head",
                handout=config.handout,
            )
            if eviction
            else None
        )

    @property
    def tree(self) -> KnowledgeTree:
        return self.lifecycle.tree

    def serve(self, request: EngineRequest, prompt: BuiltPrompt | None = None) -> Served:
        """Run one request through the engine's tiers; return what it read and its time.
        `prompt`: the request's documents in the order served (default: `request.prompt()`)."""
        cfg, pool, window = self.config, self.pool, self.window
        prompt = prompt or request.prompt()
        handle, sent = self.lifecycle.open(prompt, final=True)
        plan = sent or Plan(page_size=cfg.page_size)  # what reaches the engine
        if window is not None and plan.lease is not None:
            window.take_lease(plan.lease)
            window.planned(plan.keep, plan.lease)
        prompt_len = prompt.num_tokens
        total = prompt_len + cfg.max_tokens - 1  # the last answer token is never computed
        hit: list[Block] = []
        hashes: list[int] = []
        if cfg.prefix_caching:
            hashes = self.hasher.hashes(
                [*self._segments(request, prompt), (("answer",), cfg.max_tokens - 1)]
            )
            hit = pool.longest_hit(hashes[: (prompt_len - 1) // cfg.block_size])
        gpu_tokens = len(hit) * cfg.block_size
        loads, loadable = self._loads(plan, prompt_len)
        loaded = max(0, loadable - gpu_tokens)
        reading = frozenset(s for span in loads for s in span.slots) if loaded else frozenset()
        pool.touch(hit)
        blocks: list[Block] = list(hit)
        computed = gpu_tokens + loaded
        copied = [0, 0]  # tokens copied by the window: in prefill steps, in decode steps
        while True:
            prefill = computed < prompt_len
            new = min(prompt_len - computed, cfg.max_num_batched_tokens) if prefill else 1
            end = computed + new
            blocks += pool.get_new_blocks(-(-end // cfg.block_size) - len(blocks))
            if cfg.prefix_caching:
                for index in range(end // cfg.block_size):
                    pool.cache(blocks[index], hashes[index])
            computed = end
            writes = self._step_writes(reading)
            reading = frozenset()
            copied[0 if prefill else 1] += sum(w.num_tokens for w in writes)
            if prefill and computed >= prompt_len:
                self.lifecycle.first_token(handle)
            if computed >= total:
                break
            self._report(writes)
        result = self._result(plan, blocks, gpu_tokens, loaded) if sent else ConnectorResult()
        pool.free_blocks(reversed(blocks))
        self._report(writes)
        if sent:
            self.lifecycle.settle(handle, result)
        cached = gpu_tokens + loaded
        hits, _ = served_hits(handle, result, prompt, cached, cfg.block_size)
        stored = sum(span.num_tokens for span in plan.store)
        return Served(
            prompt_tokens=prompt_len,
            gpu_tokens=gpu_tokens,
            loaded_tokens=loaded,
            doc_tokens=sum(spec.num_tokens for spec in prompt.doc_specs),
            cached_doc_tokens=_covered(prompt, cached),
            docs=len(prompt.doc_specs),
            gpu_docs=hits.gpu_docs,
            host_docs=hits.host_docs,
            prefill_s=self.cost_model.prefill_time(cached, prompt_len - cached),
            load_s=self.copies.seconds(loaded),
            copy_s=self.copies.seconds(copied[0] + stored),
            after_s=self.copies.seconds(copied[1]),
        )

    def run(self, requests: Sequence[EngineRequest], *, skip: int = 0) -> EngineResult:
        """Serve `requests` in order; totals over all but the first `skip` (a warm-up)."""
        served = [self.serve(r) for r in requests][skip:]
        return self.result(served)

    def result(self, served: Sequence[Served]) -> EngineResult:
        prompt = sum(s.prompt_tokens for s in served)
        cached = sum(s.cached_tokens for s in served)
        doc_tokens = sum(s.doc_tokens for s in served)
        cached_docs = sum(s.cached_doc_tokens for s in served)
        docs = sum(s.docs for s in served)
        gpu = sum(s.gpu_docs for s in served)
        host = sum(s.host_docs for s in served)
        return EngineResult(
            requests=len(served),
            prompt_tokens=prompt,
            cached_tokens=cached,
            doc_tokens=doc_tokens,
            cached_doc_tokens=cached_docs,
            token_hit_rate=ratio(cached, prompt),
            doc_token_hit_rate=ratio(cached_docs, doc_tokens),
            doc_hit_rate=ratio(gpu + host, docs),
            gpu_doc_hit_rate=ratio(gpu, docs),
            host_doc_hit_rate=ratio(host, docs),
            host_slots_written=self.tree.counters.host_slots_written,
            vllm_block_evictions=self.pool.evictions,
        )

    def _segments(self, request: EngineRequest, prompt: BuiltPrompt) -> list[Segment]:
        """The prompt's runs of tokens as vLLM's block hashes name them."""
        question = request.question
        if not isinstance(question, TokenIds):
            question = ("question", question)
        return [
            ("root", len(prompt.root_ids)),
            *((spec.key, spec.num_tokens) for spec in prompt.doc_specs),
            (question, len(prompt.question_ids)),
        ]

    def _loads(self, plan: Plan, prompt_len: int) -> tuple[tuple[LoadSpan, ...], int]:
        """The load spans the connector runs for `plan` and where its loads end, as the
        scheduler side counts them (`SchedulerSide.track_and_count_loads`): short of a lent
        victim overwritten meanwhile, or past the plan's loads over copies the tree has not
        applied (`EvictionWindow.copied_loads`)."""
        window = self.window
        loadable = min(plan.num_loaded_tokens, prompt_len - 1)
        if window is None:
            return plan.load, loadable
        limit = window.load_limit(plan)
        if limit is not None:  # a lent victim it reads was overwritten: vLLM computes it
            return plan.load, min(loadable, limit)
        if loadable == plan.num_loaded_tokens:
            copied = window.copied_loads(plan, loadable)
            if copied:
                last = copied[-1]
                loadable = min(last.token_start + last.num_tokens, prompt_len - 1)
            return plan.load + copied, loadable
        return plan.load, loadable

    def _result(
        self, plan: Plan, blocks: list[Block], gpu_tokens: int, loaded: int
    ) -> ConnectorResult:
        """The connector's report at the request's finish (`SchedulerSide.finished`): its
        keep spans recorded first, then the window's changes since the previous report."""
        window, lease = self.window, plan.lease
        changes: tuple[Any, Any, Any] = ((), (), ())
        overwritten: tuple[tuple[int, int], ...] = ()
        if window is not None and lease is not None:
            if plan.keep:
                block_ids = [b.block_id for b in blocks]
                window.record(
                    plan.keep, block_ids, self.pool, epoch=lease.epoch, version=lease.version
                )
            changes = window.take_changes()
            overwritten = window.take_overwritten()
        copied, dropped, gone = changes
        return ConnectorResult(
            loaded_tokens=loaded,
            external_tokens=loaded,
            gpu_tokens=gpu_tokens,
            host_tokens=loaded,
            store_scheduled=bool(plan.store),
            stored=bool(plan.store),
            host_copied=copied,
            host_overwritten=overwritten,
            host_dropped=dropped,
            host_gone=gone,
            host_lost=window.take_losses() if window is not None else NO_LOSSES,
            reported=True,
        )

    def _step_writes(self, reading: frozenset[int]) -> list[HostWrite]:
        """The step's eviction-time copies (at hand-out and look-ahead); none overwrites a
        victim that `reading`, the step's loads, reads."""
        if self.window is None:
            return []
        handout, lookahead = self.window.step_writes(self.pool, reading)
        return [*handout, *lookahead]

    def _report(self, writes: Sequence[HostWrite]) -> None:
        """A step's worker report: every copy the window asked for ran."""
        if self.window is not None:
            self.window.on_report({w.key for w in writes}, self.pool)


def _covered(prompt: BuiltPrompt, cached: int) -> int:
    """Document tokens inside the first `cached` prompt tokens (what a token hit rate counts
    of the documents)."""
    covered, end = 0, len(prompt.root_ids)
    for spec in prompt.doc_specs:
        start, end = end, end + spec.num_tokens
        covered += max(0, min(end, cached) - start)
    return covered


def ratio(num: float, den: float) -> float:
    return num / den if den else 0.0
