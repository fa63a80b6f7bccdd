"""`Lifecycle`: the one owner of the knowledge tree in the runtime. Every change to the tree on
the request path, and every admin change (invalidate, clear, the GPU tier lost with an
engine), goes through it; everything else in `runtime/` only asks it.

    open            KnowledgeTree.begin_request (match, pin, evict, allocate, plan), then the
                    plan checked exactly as the connector will check it (`plan_problems`): a
                    plan the connector would ignore is never sent
        ▼  submit: the plan goes with the request (`kv_transfer_params`)
    first_token     the request's stores ran (they run synchronously in the step that
                    completes the prompt, and its plan was checked before it went out): its
                    copies become readable and its pins go
        ▼  finish: the connector's report (`ConnectorResult`)
    settle          a failed load removes the node it read; a handle still open (no first
                    token seen) is confirmed or aborted by the report; the eviction-time
                    host writes the report carries (any request's) become host copies
    abort           the request died before its first token: its unconfirmed copies go
    adopt           a speculation became the answer: it counts toward the policy's frequency

`served_hits` (what the request read, per tier) only reads a handle and a report.

The async runtime (`generation.py`, over vLLM's `AsyncLLM`) runs every step and confirms at
the first token; the tests' `run_request` (tests/_sync_run.py, over the synchronous
`vllm.LLM`, which only returns finished requests) has no first token to watch, so `settle`
confirms its handle at the end.
The simulator (`sim/engine.py`) and `bench overhead` drive the tree through this class too, with
plans checked against the tree's own sizes (`Lifecycle.of`): one protocol, one implementation.
Not thread-safe: used from RAGCache's loop (or one thread) only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from ragcache_core.engine.connector.report import ConnectorResult
from ragcache_core.engine.connector.spans import plan_problems
from ragcache_core.engine.connector.step_costs import NO_STEPS, StepCosts
from ragcache_core.plan import Plan, Tier
from ragcache_core.query_result import CacheHits
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.tree import KnowledgeTree, RequestHandle
from ragcache_core.tree.request import RequestState

logger = logging.getLogger(__name__)


class PlanLimits(Protocol):
    """What the connector checks a plan against (`plan_problems`): its page size and host
    pool. `ConnectorConfig` is one; `Lifecycle.of` takes the tree's own."""

    @property
    def page_size(self) -> int: ...

    @property
    def host_slots(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _TreeLimits:
    page_size: int
    host_slots: int


class Lifecycle:
    """The knowledge tree's owner for one `RAGCache` (see the module docstring). `tree` is
    readable by anyone (stats, counters); only the methods below change it. `connector`: what
    the engine's connector checks plans against (its `ConnectorConfig`)."""

    def __init__(self, tree: KnowledgeTree, connector: PlanLimits) -> None:
        self.tree = tree
        self._connector = connector
        self.engine_steps: StepCosts = NO_STEPS
        """The engine's steps and copies, as its newest report said (`StepCosts`: since the
        engine started)."""
        self._steps_generation = 0

    @classmethod
    def of(cls, tree: KnowledgeTree) -> Lifecycle:
        """The owner of a tree with no connector behind it (the simulator's, `bench
        overhead`'s): its plans are checked against the tree's own page size and host slots,
        as a connector built from the same configuration would check them."""
        return cls(tree, _TreeLimits(tree.page_size, tree.stats().host_slots))

    # ------------------------------------------------------------------ reads

    def score(self, prompt: BuiltPrompt) -> tuple[int, int]:
        """(cached tokens, tokens to compute): the admission queue's view of a prompt."""
        match = self.tree.match(prompt.doc_specs, prompt.root_key)
        cached = match.cached_tokens + match.vllm_tokens
        return cached, prompt.num_tokens - cached

    def score_ordered(self, prompt: BuiltPrompt) -> tuple[int, int]:
        """`score` of a `document_order="cache"` request: the hits of the order that follows
        the cached path now (`KnowledgeTree.ordered_hits`, by document id), the order its
        prompt is built in when it opens (`Generator.reordering`)."""
        ids = [spec.key.doc_id for spec in prompt.doc_specs]
        cached = self.tree.ordered_hits(ids, prompt.root_key)[1]
        return cached, prompt.num_tokens - cached

    def blocked(self, prompt: BuiltPrompt) -> bool:
        """Whether the next document of the prompt's readable prefix is being written by a
        request in prefill (admission defers the prompt until it is readable)."""
        return self.tree.match(prompt.doc_specs, prompt.root_key).in_flight > 0

    # ------------------------------------------------------------------ the request path

    def open(self, prompt: BuiltPrompt, *, final: bool) -> tuple[RequestHandle, Plan | None]:
        """Plan the request in the tree; returns its handle and the plan to send (None: run it
        uncached, the plan is empty or was refused).

        Mutates the tree (pins, allocations): the caller must end the handle (`first_token`
        or `settle`, or `abort` on any error). A plan that `plan_problems` refuses is a bug:
        logged, and the handle aborted here."""
        tree, connector = self.tree, self._connector
        handle = tree.begin_request(
            len(prompt.root_ids),
            prompt.doc_specs,
            len(prompt.question_ids),
            final=final,
            root_key=prompt.root_key,
        )
        if handle.plan.is_empty:
            return handle, None
        problems = plan_problems(
            handle.plan,
            prompt_len=prompt.num_tokens,
            page_size=connector.page_size,
            host_slots=connector.host_slots,
        )
        if problems:
            logger.error("RAGCache built an invalid plan (%s); running uncached", problems)
            tree.abort(handle)
            return handle, None
        return handle, handle.plan

    def first_token(self, handle: RequestHandle) -> None:
        """The request produced its first token: its stores ran, so its copies become
        readable and its pins go. A handle aborted at planning (its plan refused) is left as
        it is."""
        if handle.is_open:
            self.tree.confirm(handle)

    def settle(self, handle: RequestHandle, result: ConnectorResult) -> bool:
        """Apply the connector's final report on a request; returns whether its copies stand.

        An open handle (no first token was watched) is confirmed when every copy ran (plan not
        rejected, no load failed, stores reported run), else aborted. A handle confirmed at its
        first token is only re-checked: a report contradicting that is a bug, logged, and the
        request's written copies leave the tree. A handle aborted at planning sent no plan:
        nothing to settle. Either way a failed load removes the node it read, at this prefix
        only (`KnowledgeTree.invalidate_loads`). The report's eviction-time host writes are
        applied last: what it says left vLLM's blocks may be this request's own documents,
        which its confirmation marks as held there."""
        confirmed = self._settle_copies(handle, result)
        if result.reported:
            self.apply_host_writes(result, handle.engine_generation)
        return confirmed

    def apply_host_writes(self, result: ConnectorResult, engine_generation: int) -> None:
        """The eviction-time host writes a report carries (any request's, or the report
        probe's: `runtime/report_probe.py`) become host copies, unless the engine that made
        it (`engine_generation`, the tree's when its request was planned) was lost since: see
        `KnowledgeTree.apply_host_writes`. The report's step costs replace older ones (they
        are the engine's totals; a new engine's restart from 0, a lost one's are ignored)."""
        newest = (self._steps_generation, self.engine_steps.steps)
        if (engine_generation, result.steps.steps) >= newest:
            self._steps_generation, self.engine_steps = engine_generation, result.steps
        self.tree.apply_host_writes(
            result.host_copied,
            result.host_dropped,
            result.stranded_blocks,
            result.host_gone,
            result.host_lost,
            result.host_overwritten,
            engine_generation=engine_generation,
        )

    def _settle_copies(self, handle: RequestHandle, result: ConnectorResult) -> bool:
        """`settle`'s confirmation or abort of `handle`, and the removal of a failed load's
        node; whether its copies stand."""
        tree = self.tree
        if handle.state is RequestState.ABORTED:
            return False
        every_copy_ran = not result.rejected and (result.stored or not handle.plan.store)
        if handle.is_open:
            confirmed = every_copy_ran and not result.load_failed
            if confirmed:
                tree.confirm(handle)
            else:
                tree.abort(handle)
        else:
            confirmed = every_copy_ran
            if not confirmed:
                logger.error(
                    "the connector did not run a confirmed plan (rejected: %s; stores ran: %s): "
                    "dropping the request's copies",
                    "; ".join(result.rejected) or "no",
                    result.stored,
                )
                tree.invalidate_written(handle)
        if result.load_failed:
            tree.invalidate_loads(handle, result.failed_load_spans)
        return confirmed

    def abort(self, handle: RequestHandle) -> None:
        """The request ended without its stores proven (an error, a cancellation, a timeout):
        its unconfirmed copies are dropped and its pins go. A handle already ended is left
        as it is."""
        if handle.is_open:
            self.tree.abort(handle)

    def adopt(self, handle: RequestHandle) -> None:
        """A speculative generation became the answer: it counts toward the policy's frequency
        like a final request."""
        self.tree.mark_final(handle)

    # ------------------------------------------------------------------ admin

    def invalidate(self, doc_id: str) -> int:
        """Drop every cached node of `doc_id` (and what was computed after it); the number of
        nodes dropped. In-flight readers keep their pins; nothing stale is served."""
        return self.tree.invalidate(doc_id)

    def clear(self) -> None:
        """Forget every cached document (the policy's clocks and frequencies restart too)."""
        self.tree.clear()

    def lose_gpu_tier(self) -> None:
        """The engine died: every GPU copy went with its worker; confirmed host copies
        stay."""
        self.tree.drop_tier(Tier.GPU)

    def check_integrity(self) -> None:
        """Verify the tree's invariants; raises `IntegrityError` naming the first violation."""
        self.tree.check_integrity()


def served_hits(
    handle: RequestHandle,
    result: ConnectorResult,
    prompt: BuiltPrompt,
    vllm_cached: int,
    block_size: int,
) -> tuple[CacheHits, int]:
    """What the request read: hits per tier and the document tokens they cover.

    The GPU tier is vLLM's prefix cache: `vllm_cached` (vLLM's `num_cached_tokens`) less the tokens
    it accepted from the connector is its hit, and a document inside it is a GPU hit whether or not
    the tree holds it; a document past it inside the tokens the connector loaded was loaded from
    the host tier (the tree's hit prefix, or a copy the engine made that the tree had not applied
    yet; fewer when a victim it read was overwritten).
    A document that ends inside a block shared with what follows it (the question, another
    document) and that the host tier does not serve is a GPU hit when vLLM's hit covers every
    block up to that one: only its tail, under `block_size` tokens, was recomputed (with the host
    tier written at eviction a recent document is in vLLM's blocks alone; docs/design.md 2.2,
    "Document seams"). Nothing the tree planned counts as read when the plan was refused (by the
    app or the connector) or a load failed; vLLM's own hit still counts (its blocks are keyed by
    token ids: an invalidated document's unchanged text still hits there, exactly; a changed one
    never does).

    ```
    prompt    | root | doc A      | doc B        | question |
    blocks    |  0   |  1   |  2   |  3   |  4   |  5   |      (block 4: B's tail + question)
    vLLM hit  [===========================]                   (blocks 0-3)
    -> A and B are GPU hits; B's tail in block 4 is recomputed
    ```
    """
    served = (
        handle.state is not RequestState.ABORTED and not result.rejected and not result.load_failed
    )
    on_gpu = max(0, vllm_cached - result.external_tokens)
    gpu = host = covered = 0
    end = len(prompt.root_ids)
    for spec in prompt.doc_specs:
        start, end = end, end + spec.num_tokens
        if spec.num_tokens and end <= on_gpu:
            gpu += 1
        elif served and end <= on_gpu + result.loaded_tokens:  # loaded: the tree's hits, or
            host += 1  # copies the engine made that the tree had not applied
        elif start < on_gpu and end - end % block_size <= on_gpu:
            gpu += 1  # its tail, in the block it shares with what follows, was recomputed
            covered += on_gpu - start
            continue
        else:
            continue
        covered += spec.num_tokens
    cached = on_gpu + result.loaded_tokens
    hits = CacheHits(
        gpu_docs=gpu,
        host_docs=host,
        computed_docs=len(prompt.doc_specs) - gpu - host,
        root_cached=len(prompt.root_ids) <= cached and bool(prompt.root_ids),
        cached_tokens=cached,
        computed_tokens=prompt.num_tokens - cached,
    )
    return hits, covered
