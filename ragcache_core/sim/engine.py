"""The engine's tiers, simulated: vLLM's prefix-cached blocks under LRU, and the host tier.

`ragcache simulate --engine` (and `--replay serve.json`) model what the engine does, not the
paper's two pools (`simulator.py`):

  * the GPU tier is vLLM's block pool (`sim.blocks.BlockPool`): a request hits the longest
    run of cached full blocks of its prompt (at most `prompt - 1` tokens), takes new blocks
    from the head of the free queue (evicting their hashes), caches each block once full, and
    at its end frees its blocks in reverse order (cached ones to the tail);
  * the host tier is the engine's own `KnowledgeTree` (no GPU slots, `host_write` as set):
    its plans load the host copies of the prompt's readable prefix past vLLM's hit, store
    computed documents as they are computed (`compute`), or keep them for the eviction window
    (`eviction`); the policy (DGDSF, ...) and `store_policy` decide host admission and host
    eviction there as in the engine;
  * with `eviction`, the engine's own `EvictionWindow` runs over the block pool every step:
    it copies a kept document when the pool hands one of its blocks out (and, with a
    look-ahead, as its blocks reach the head of the free queue, handing them back at the head
    or the tail: `host_write_return`); every copy succeeds.

Requests run one at a time, in order (the engine overlaps a few: its hit rate can differ).
A request's steps are vLLM's: its prefill in chunks of `max_num_batched_tokens`, then one step
per answer token after the first (`max_tokens - 1`); the window runs once a step. The
engine's order at a request's last step is kept: the request's keeps are recorded, the
window's changes since the previous report are taken, its blocks are freed, and then the
step's copies are handed back. Timing (TTFT, queueing) is not modelled here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ragcache_core.capacity import slots_in_tokens
from ragcache_core.cost import CostModel, default_cost_model
from ragcache_core.engine.connector.window import EvictionWindow
from ragcache_core.errors import ConfigError
from ragcache_core.policy import DEFAULT_POLICY
from ragcache_core.sim.blocks import Block, BlockHasher, BlockPool, Segment, TokenIds
from ragcache_core.trace import TraceRequest
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RootKey

ENGINE_ROOT = RootKey(model="sim", tokenizer="sim", template="sim", kv_dtype="sim")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's settings that decide its hits. `vllm_blocks`: vLLM's KV cache in blocks
    of `block_size` tokens (its null block included); `host_tokens`: the host pool, in slots
    of `page_size` tokens; `window_tokens`: the eviction window's look-ahead (0, the engine's
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

    def __post_init__(self) -> None:
        if self.host_write not in ("compute", "eviction"):
            raise ConfigError(f"unknown host_write {self.host_write!r}; choose compute or eviction")
        if self.host_write_return not in ("head", "tail"):
            raise ConfigError(
                f"unknown host_write_return {self.host_write_return!r}; choose head or tail"
            )
        if self.host_write == "eviction" and self.host_tokens <= 0:
            raise ConfigError("host_write='eviction' writes the host tier; host_tokens is 0")
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
        """A trace request as `ragcache simulate --engine` serves it (`Simulator.specs`'s keys);
        its id names the question's tokens."""
        docs = tuple(
            DocSpec(DocKey(doc, str(n)), n)
            for doc, n in zip(request.docs, request.doc_tokens, strict=True)
        )
        return cls(system_tokens, docs, request.question_tokens, request.id)


@dataclass(frozen=True, slots=True)
class Served:
    """What one request read: tokens vLLM had (`gpu_tokens`), tokens loaded from the host
    tier, and its documents' share of them."""

    prompt_tokens: int
    gpu_tokens: int
    loaded_tokens: int
    doc_tokens: int
    cached_doc_tokens: int
    docs: int
    gpu_docs: int
    host_docs: int

    @property
    def cached_tokens(self) -> int:
        return self.gpu_tokens + self.loaded_tokens


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
    """vLLM's block pool, the host tree and (eviction mode) the window, across `serve` calls."""

    def __init__(self, config: EngineConfig, cost_model: CostModel | None = None) -> None:
        self.config = config
        eviction = config.host_write == "eviction"
        self.tree = KnowledgeTree(
            ENGINE_ROOT,
            host_slots=slots_in_tokens(config.host_tokens, config.page_size),
            page_size=config.page_size,
            policy=config.policy,
            cost_model=cost_model or default_cost_model(),
            max_depth=config.max_depth,
            store_policy=config.store_policy,
            block_size=config.block_size,
            host_write=config.host_write,
            host_lease_slots=-(-config.max_num_batched_tokens // config.page_size)
            if eviction
            else 0,
            host_lease_victims=config.lease_victims,
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

    def serve(self, request: EngineRequest) -> Served:
        """Run one request through the engine's tiers; return what it read."""
        cfg, pool = self.config, self.pool
        handle = self.tree.begin_request(request.root_tokens, request.docs, request.question_tokens)
        plan = handle.plan
        if self.window is not None and plan.lease is not None:
            self.window.take_lease(plan.lease)
        segments: list[Segment] = [("root", request.root_tokens)]
        segments += [(spec.key, spec.num_tokens) for spec in request.docs]
        question = request.question
        if not isinstance(question, TokenIds):
            question = ("question", question)
        segments.append((question, request.question_tokens))
        prompt_len = sum(length for _, length in segments)
        total = prompt_len + cfg.max_tokens - 1  # the last answer token is never computed
        hashes = self.hasher.hashes([*segments, (("answer",), cfg.max_tokens - 1)])
        hit = pool.longest_hit(hashes[: (prompt_len - 1) // cfg.block_size])
        gpu_tokens = len(hit) * cfg.block_size
        loadable = min(plan.num_loaded_tokens, prompt_len - 1)
        limit = self.window.load_limit(plan) if self.window is not None else None
        if limit is not None:  # a lent victim it reads was overwritten: vLLM computes it
            loadable = min(loadable, limit)
        elif self.window is not None and loadable == plan.num_loaded_tokens:
            copied = self.window.copied_loads(plan, loadable)  # copies the tree has not applied
            if copied:
                loadable = min(copied[-1].token_start + copied[-1].num_tokens, prompt_len - 1)
        loaded = max(0, loadable - gpu_tokens)
        pool.touch(hit)
        blocks: list[Block] = list(hit)
        computed = gpu_tokens + loaded
        while True:
            new = (
                min(prompt_len - computed, cfg.max_num_batched_tokens)
                if computed < prompt_len
                else 1
            )
            end = computed + new
            blocks += pool.get_new_blocks(-(-end // cfg.block_size) - len(blocks))
            for index in range(end // cfg.block_size):
                pool.cache(blocks[index], hashes[index])
            computed = end
            writes = self._step_writes()
            if computed >= total:
                break
            self._report(writes)
        changes: tuple[Any, Any, Any] = ((), (), ())
        overwritten: tuple[tuple[int, int], ...] = ()
        if self.window is not None and plan.lease is not None:
            if plan.keep:
                block_ids = [b.block_id for b in blocks]
                lease = plan.lease
                self.window.record(
                    plan.keep, block_ids, pool, epoch=lease.epoch, version=lease.version
                )
            changes = self.window.take_changes()
            overwritten = self.window.take_overwritten()
        pool.free_blocks(reversed(blocks))
        self._report(writes)
        self.tree.confirm(handle)
        copied, dropped, gone = changes
        self.tree.apply_host_writes(copied, dropped, gone=gone, overwritten=overwritten)
        return _served(request, prompt_len, gpu_tokens, loaded, cfg.block_size)

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
            token_hit_rate=_ratio(cached, prompt),
            doc_token_hit_rate=_ratio(cached_docs, doc_tokens),
            doc_hit_rate=_ratio(gpu + host, docs),
            gpu_doc_hit_rate=_ratio(gpu, docs),
            host_doc_hit_rate=_ratio(host, docs),
            host_slots_written=self.tree.counters.host_slots_written,
            vllm_block_evictions=self.pool.evictions,
        )

    def _step_writes(self) -> list[Any]:
        """The step's eviction-time copies (at hand-out and look-ahead; one request at a
        time, so no load of the step reads a victim they could overwrite)."""
        if self.window is None:
            return []
        handout, lookahead = self.window.step_writes(self.pool)
        return [*handout, *lookahead]

    def _report(self, writes: Sequence[Any]) -> None:
        """A step's worker report: every copy the window asked for ran."""
        if self.window is not None:
            self.window.on_report({w.key for w in writes}, self.pool)


def _served(
    request: EngineRequest,
    prompt_len: int,
    gpu: int,
    loaded: int,
    block_size: int,
) -> Served:
    """Per document as `runtime.lifecycle.served_hits` counts: on GPU when vLLM's hit covers
    it (or every block of it up to the one it shares with what follows), from the host when the
    tokens loaded cover it, else computed."""
    cached = gpu + loaded
    end = request.root_tokens
    gpu_docs = host_docs = cached_doc_tokens = 0
    for spec in request.docs:
        start, end = end, end + spec.num_tokens
        cached_doc_tokens += max(0, min(end, cached) - start)
        if spec.num_tokens and end <= gpu:
            gpu_docs += 1
        elif end <= cached:  # the tree's hits, or copies it had not applied (`copied_loads`)
            host_docs += 1
        elif start < gpu and end - end % block_size <= gpu:
            gpu_docs += 1
    return Served(
        prompt_tokens=prompt_len,
        gpu_tokens=gpu,
        loaded_tokens=loaded,
        doc_tokens=sum(spec.num_tokens for spec in request.docs),
        cached_doc_tokens=cached_doc_tokens,
        docs=len(request.docs),
        gpu_docs=gpu_docs,
        host_docs=host_docs,
    )


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0
