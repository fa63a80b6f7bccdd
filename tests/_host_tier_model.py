"""The model behind tests/test_host_tier_fuzz.py. The real `KnowledgeTree` plans and the real
`SchedulerSide` (its `EvictionWindow`) runs over vLLM's real `BlockPool`; this file plays
vLLM's scheduler (admission, chunked prefill, block caching, preemption, finishes, aborts),
the worker (the copies at hand-out and the loads, before the forward pass only in a step vLLM
flags as loading synchronously, `SchedulerOutput.has_sync_kv_loads`, else after it, as vLLM
0.32 calls `start_load_kv`; forward passes; the look-ahead's copies) and the
app (plans, first tokens, reports late, out of order or lost, `invalidate`, `clear`, engine
restarts). What each vLLM block and host slot holds is tracked per token (its path from the
root and its offset there), written only where the engine writes bytes (a forward pass, a
load, a window copy), never from the tree's beliefs; a load must read the prompt's own
tokens, or `Scenario.run` raises `Violation` with the seed and the last actions. A dead
engine's report may reach the app after the restart (the tree must ignore it:
`KnowledgeTree.engine_generation`). A burst scenario has long documents, a large step budget
and many requests at once (several long prefills in one step). A kept document that leaves
vLLM's blocks uncopied is a `Violation` when nothing but a hand-out can have taken it
(`missed`), or, in a roomy scenario (a host tier that never fills), for lack of lease room.
Not modelled: load failures, the report probe."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from ragcache_core.engine.connector import ConnectorConfig, ConnectorResult
from ragcache_core.engine.connector.config import RESULT_KEY
from ragcache_core.engine.connector.metadata import StepOps, WorkerReport
from ragcache_core.engine.connector.scheduler_side import SchedulerSide
from ragcache_core.engine.connector.spans import plan_problems
from ragcache_core.plan import PLAN_KEY, Plan, Tier
from ragcache_core.runtime.lifecycle import Lifecycle
from ragcache_core.storage.pool_layout import PoolLayout
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RequestHandle
from tests._host_tier_counts import Counts
from tests._tree_helpers import ROOT

TICKS = 240
DOC_IDS = "abcde"

Token = tuple[tuple[str, ...], int]
"""A token's identity: the path it sits on (root, documents with their versions, the question,
the answer) and its offset there. Two positions hold the same KV iff their identities match."""


class Violation(AssertionError):
    """A load read a host slot that does not hold the prompt's token (or a hit was wrong)."""


@dataclass(frozen=True)
class Settings:
    block: int
    page: int
    root_tokens: int
    host_slots: int
    window_blocks: int
    back_to_head: bool
    vllm_blocks: int
    budget: int
    policy: str
    lose: float
    fail_copy: float
    max_doc: int
    """Documents have 1 to `max_doc` tokens (9, or 40 in a burst scenario)."""
    roomy: bool
    """The host tier holds every path several times over: it never fills."""

    @classmethod
    def draw(cls, rng: random.Random) -> Settings:
        block, page = rng.choice([(4, 2), (4, 4), (2, 2), (8, 4), (2, 4)])
        burst = rng.random() < 0.3
        roomy = rng.random() < 0.25
        max_doc = 40 if burst else 9
        return cls(
            block=block,
            page=page,
            root_tokens=rng.randint(1, 6),
            host_slots=100 * max_doc // page if roomy else rng.randint(6, 20) * (4 if burst else 1),
            window_blocks=rng.choice([0, 0, 1, 2, 4]),
            back_to_head=rng.random() < 0.5,
            vllm_blocks=rng.randint(60, 120) * (5 if burst else 1) // block,
            budget=rng.randint(4, 16) * (4 if burst else 1),
            policy=rng.choice(["dgdsf", "pgdsf", "lru"]),
            lose=rng.choice([0.0, 0.1, 0.3]),
            fail_copy=rng.choice([0.0, 0.05]),
            max_doc=max_doc,
            roomy=roomy,
        )


@dataclass
class Request:
    """One request as both sides see it."""

    rid: str
    handle: RequestHandle
    params: dict[str, Any] | None
    tokens: list[Token]
    """Prompt tokens, then the answer tokens whose KV is computed (all but the last)."""
    prompt_len: int
    max_tokens: int
    blocks: list[Any] = field(default_factory=list)
    computed: int = 0
    outputs: int = 0
    new: bool = True
    """Not yet in a built step (vLLM's `scheduled_new_reqs` next time)."""
    resumed: bool = False
    """Preempted, and not in a built step since (vLLM's `resumed_req_ids` next time)."""
    sent: int = 0
    """Blocks already named to the worker."""
    hit: int = 0
    """vLLM's prefix-cache hit at admission, in tokens (checked after the step's forward pass:
    a block cached at allocation by a request of the same step is computed in that pass)."""


def _hash(parent: bytes, tokens: Sequence[Token]) -> bytes:
    return hashlib.blake2b(repr((parent, tuple(tokens))).encode(), digest_size=16).digest()


class Scenario:
    """One seeded run: the app (tree, inbox) and the engine (block pool, scheduler side)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = rng = random.Random(seed)
        self.s = s = Settings.draw(rng)
        self.counts = Counts(scenarios=1)
        self.log: list[str] = []
        self.tick = 0
        self.sync_loads = False
        """Whether a request admitted in this step loads external tokens (vLLM's flag)."""
        lease = -(-s.budget // s.page)  # a step's budget, as the engine's tree has it
        self.tree = KnowledgeTree(
            ROOT,
            host_slots=s.host_slots,
            page_size=s.page,
            policy=s.policy,
            block_size=s.block,
            host_write="eviction",
            host_lease_slots=lease,
        )
        self.config = ConnectorConfig(
            layout=PoolLayout(
                num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", page_size=s.page
            ),
            host_slots=s.host_slots,
            host_pool_name="fuzz",
            host_write="eviction",
            window_blocks=s.window_blocks,
            back_to_head=s.back_to_head,
        )
        self.lifecycle = Lifecycle(self.tree, self.config)  # the app's path for a report
        self.new_engine()
        self.host: dict[tuple[int, int], Token | None] = {}
        """(host slot, row) -> the token whose KV it holds (written by copies only)."""
        self.doc_tokens = {d: rng.randint(1, s.max_doc) for d in DOC_IDS}
        self.doc_version = dict.fromkeys(DOC_IDS, 0)
        self.submitting: list[tuple[int, Request]] = []
        """Planned, on the way to the engine (due tick): they may arrive out of order."""
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.inbox: list[tuple[int, int, str, Request, ConnectorResult | None]] = []
        """(due tick, order produced, kind, request, report)."""
        self.produced = 0
        self.applied_order = 0
        self.reset_pending = False
        self.dying = False
        """The engine dies in its next step, after the step's copies ran."""
        self.next_rid = 0

    def new_engine(self) -> None:
        s = self.s
        self.side = SchedulerSide(self.config, s.block)
        self.pool = BlockPool(s.vllm_blocks, enable_caching=True, hash_block_size=s.block)
        self.side.bind_block_pool(self.pool)
        self.paged: dict[tuple[int, int], Token | None] = {}
        """(vLLM block id, offset) -> the token whose KV it holds."""

    # ------------------------------------------------------------------ driver

    def run(self) -> Counts:
        rng = self.rng
        actions = [(0.3, self.start), (0.05, self.preempt), (0.03, self.abort)]
        actions += [(0.02, self.invalidate), (0.007, self.clear), (0.002, self.restart)]
        actions += [(0.002, self.die_in_next_step)]
        for self.tick in range(TICKS):
            roll = rng.random()
            for chance, action in actions:
                if roll < chance:
                    action()
                    break
                roll -= chance
            self.submit()
            self.deliver()
            if rng.random() < 0.7:
                self.step()
            self.counts.actions += 1
        while self.submitting or self.waiting or self.running:  # drain
            self.tick += 1
            self.submit()
            self.step()
            self.deliver()
        self.tick += 1000
        self.deliver()
        return self.counts

    def die_in_next_step(self) -> None:
        self.dying = True

    def fail(self, message: str) -> None:
        tail = "\n  ".join(self.log[-40:])
        raise Violation(f"seed {self.seed} ({self.s}), tick {self.tick}: {message}\n  {tail}")

    # ------------------------------------------------------------------ the app

    def doc(self, name: str) -> DocSpec:
        version = self.doc_version[name]
        return DocSpec(DocKey(name, f"{name}@{version}"), self.doc_tokens[name])

    def start(self) -> None:
        rng, s = self.rng, self.s
        if len(self.submitting) + len(self.waiting) + len(self.running) >= 6 + 4 * (s.max_doc > 9):
            return
        names = rng.sample(DOC_IDS[: rng.choice([3, 5])], rng.randint(1, 3))
        docs = [self.doc(n) for n in names]
        qid = rng.randint(0, 3)
        question = rng.randint(1, 4)
        max_tokens = rng.randint(1, 3)
        handle = self.tree.begin_request(s.root_tokens, docs, question)
        plan = handle.plan
        path: tuple[str, ...] = ("root",)
        tokens: list[Token] = [(path, i) for i in range(s.root_tokens)]
        for spec in docs:
            path = (*path, spec.key.content_hash)
            tokens += [(path, i) for i in range(spec.num_tokens)]
        path = (*path, f"q{qid}")
        tokens += [(path, i) for i in range(question)]
        prompt_len = len(tokens)
        tokens += [((*path, "answer"), i) for i in range(max_tokens - 1)]
        problems = plan_problems(
            plan, prompt_len=prompt_len, page_size=s.page, host_slots=s.host_slots
        )
        if problems:
            self.fail(f"the tree built an invalid plan: {problems}")
        params = None if plan.is_empty else {PLAN_KEY: plan.to_json()}
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        req = Request(rid, handle, params, tokens, prompt_len, max_tokens)
        self.submitting.append((self.tick + rng.choice([0, 0, 0, 1, 3, 8, 20, 40]), req))
        self.counts.requests += 1
        self.log.append(f"{self.tick} start {rid} {names} q{qid}x{question} {_plan_str(plan)}")

    def submit(self) -> None:
        """Plans reach the engine's waiting queue when due, in any order among those due."""
        due = [entry for entry in self.submitting if entry[0] <= self.tick]
        self.rng.shuffle(due)
        for entry in due:
            self.submitting.remove(entry)
            self.waiting.append(entry[1])
            self.log.append(f"{self.tick} submit {entry[1].rid}")

    def preempt(self) -> None:
        """vLLM preempts a request in prefill (out of blocks): its blocks go, it waits at the
        front and is scheduled again from its prefix-cache hit (the connector is asked again)."""
        prefilling = [r for r in self.running if r.outputs == 0]
        if not prefilling:
            return
        req = self.rng.choice(prefilling)
        self.log.append(f"{self.tick} preempt {req.rid}")
        self.counts.preemptions += 1
        self.running.remove(req)
        self.pool.free_blocks(reversed(req.blocks))
        req.blocks, req.computed, req.resumed, req.sent = [], 0, True, 0
        self.waiting.insert(0, req)

    def abort(self) -> None:
        live = [r for _, r in self.submitting] + self.waiting + self.running
        if not live:
            return
        req = self.rng.choice(live)
        self.log.append(f"{self.tick} abort {req.rid}")
        self.counts.aborts += 1
        self.submitting = [e for e in self.submitting if e[1] is not req]
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        self.side.finished(req.rid, aborted=True)  # vLLM drops an aborted request's report
        self.pool.free_blocks(reversed(req.blocks))
        if req.handle.is_open:
            self.tree.abort(req.handle)

    def invalidate(self) -> None:
        name = self.rng.choice(DOC_IDS)
        changed = self.rng.random() < 0.5
        if changed:  # new text: new tokens, a new content hash
            self.doc_version[name] += 1
            self.doc_tokens[name] = self.rng.randint(1, self.s.max_doc)
        self.log.append(f"{self.tick} invalidate {name} changed={changed}")
        self.counts.invalidations += 1
        self.tree.invalidate(name)
        self.tree.check_integrity()

    def clear(self) -> None:
        self.log.append(f"{self.tick} clear")
        self.counts.clears += 1
        self.tree.clear()
        self.tree.check_integrity()
        self.reset_pending = True  # `reset_prefix_cache(reset_connector=True)`, between steps

    def restart(self) -> None:
        """The engine dies and a new one starts (`Supervisor.restart`): the requests it held
        are lost (`drop_tier` aborts their handles), and each report it produced reaches the
        app before the restart, after it (ignored: its request carries the dead engine's
        generation) or never."""
        self.log.append(f"{self.tick} engine restart")
        self.counts.restarts += 1
        self.dying = False
        now, later = [], []
        for _, order, kind, req, result in self.inbox:
            fate = self.rng.randrange(3)  # reaches the app before the restart, never, or after
            if fate < 2:
                now.append((self.tick, order, kind if fate == 0 else "lost", req, result))
            else:
                later.append((self.tick + self.rng.choice([0, 1, 5]), order, kind, req, result))
        self.inbox = now
        self.deliver()
        self.inbox = later
        self.counts.after_restart += sum(1 for e in later if e[2] == "report")
        self.submitting, self.waiting, self.running = [], [], []
        self.tree.drop_tier(Tier.GPU)
        self.tree.check_integrity()
        self.new_engine()
        self.reset_pending = False

    def deliver(self) -> None:
        """Due events, in random order: a first token confirms; a report settles its
        request and applies its host writes (`Lifecycle.settle`); a lost one aborts it."""
        due = [e for e in self.inbox if e[0] <= self.tick]
        self.rng.shuffle(due)
        for event in due:
            self.inbox.remove(event)
            _, order, kind, req, result = event
            if kind == "first":
                if req.handle.is_open:
                    self.tree.confirm(req.handle)
                continue
            if kind == "lost" or result is None:
                self.log.append(f"{self.tick} lost report {req.rid}")
                if req.handle.is_open:
                    self.tree.abort(req.handle)
                continue
            if order < self.applied_order:
                self.counts.late_reports += 1
            self.check_losses(result)
            self.applied_order = max(self.applied_order, order)
            self.counts.reports += 1
            self.log.append(f"{self.tick} report {req.rid}#{order} {_report_str(result)}")
            if req.handle.is_open:
                self.tree.confirm(req.handle)
            self.lifecycle.apply_host_writes(result, req.handle.engine_generation)
            self.tree.check_integrity()

    def check_losses(self, result: ConnectorResult) -> None:
        """Every block vLLM hands out is named to the window: a kept document can leave vLLM's
        blocks uncopied only for lack of lease room (or a broken ancestor), and in a roomy
        scenario never for lack of room."""
        lost = result.host_lost
        self.counts.no_lease += lost.no_lease
        if lost.missed:
            self.fail(f"{lost.missed} kept documents left vLLM's blocks unseen by the window")
        if self.s.roomy and lost.no_lease:
            self.fail(f"{lost.no_lease} kept documents lost for lack of lease room, host roomy")

    def send(self, kind: str, req: Request, result: ConnectorResult | None = None) -> None:
        self.produced += 1
        delay = self.rng.choice([0, 0, 1, 2, 5])
        if kind == "report" and self.rng.random() < self.s.lose:
            kind = "lost"
            self.counts.lost_reports += 1
        self.inbox.append((self.tick + delay, self.produced, kind, req, result))

    # ------------------------------------------------------------------ the engine

    def hashes(self, req: Request, count: int) -> list[bytes]:
        size, out, parent = self.s.block, [], b""
        for i in range(count):
            parent = _hash(parent, req.tokens[i * size : (i + 1) * size])
            out.append(parent)
        return out

    def reserved(self) -> int:
        """Blocks the running requests will still take: a request is admitted only if its
        whole length fits beside them (vLLM would preempt; `preempt` plays that apart)."""
        size = self.s.block
        return sum(-(-len(r.tokens) // size) - len(r.blocks) for r in self.running)

    def cache_blocks(self, req: Request, end: int) -> None:
        """vLLM caches the full blocks of the tokens known at scheduling (loaded ones too)."""
        full = end // self.s.block
        for block, key in zip(req.blocks[:full], self.hashes(req, full), strict=True):
            if block.block_hash is None:
                with_group = make_block_hash_with_group_id(key, 0)
                block.set_block_hash(with_group, self.s.block)
                self.pool.cached_block_hash_to_block.insert(with_group, block)

    def admit(self, req: Request, budget: int) -> int:
        """vLLM's scheduling of a waiting request: its prefix-cache hit, the connector's
        external tokens, allocation. Returns the tokens scheduled (0: it stays waiting)."""
        s, pool = self.s, self.pool
        hits = self.hashes(req, (req.prompt_len - 1) // s.block)
        hit: list[Any] = []
        for key in hits:
            found = pool.get_cached_block(key, [0])
            if found is None:
                break
            hit.append(found[0])
        local = len(hit) * s.block
        external = 0
        if req.params is not None:
            external = self.side.track_and_count_loads(req.rid, req.params, req.prompt_len, local)
        computed = local + external
        new = min(req.prompt_len - computed, budget)
        total = -(-len(req.tokens) // s.block)
        free_hits = sum(1 for b in hit if b.ref_cnt == 0)
        if pool.get_num_free_blocks() - free_hits - self.reserved() < total - len(hit):
            return 0
        pool.touch(hit)
        req.blocks = hit + pool.get_new_blocks(-(-(computed + new) // s.block) - len(hit))
        self.cache_blocks(req, computed + new)
        if req.params is not None:
            self.side.after_alloc(req.rid, external)
        self.sync_loads = self.sync_loads or external > 0  # vLLM's `has_sync_kv_loads`
        req.computed = computed
        req.hit = local
        self.log.append(f"{self.tick} admit {req.rid} gpu={local} external={external}")
        return new

    def step(self) -> None:
        s, pool, side = self.s, self.pool, self.side
        if self.reset_pending:
            self.reset_pending = False
            pool.reset_prefix_cache()  # refused while requests hold blocks
            side.release_all()
        budget = s.budget
        scheduled: dict[str, int] = {}
        self.sync_loads = False
        for req in self.running:
            if budget <= 0:
                break
            new = min(req.prompt_len - req.computed, budget) if req.outputs == 0 else 1
            req.blocks += pool.get_new_blocks(-(-(req.computed + new) // s.block) - len(req.blocks))
            self.cache_blocks(req, min(req.computed + new, len(req.tokens)))
            scheduled[req.rid] = new
            budget -= new
        while self.waiting and budget > 0:
            req = self.waiting[0]
            new = self.admit(req, budget)
            if not new:
                break
            self.waiting.pop(0)
            self.running.append(req)
            scheduled[req.rid] = new
            budget -= new
        if not scheduled:
            return
        self.counts.steps += 1
        output = self.scheduler_output(scheduled)
        step = side.build_step(output)  # may flag the step as loading synchronously
        written = self.worker(step, scheduled, before_forward=output.has_sync_kv_loads)
        if self.dying:  # killed after the copies ran: nothing of this step is reported
            self.restart()
            return
        finished: list[Request] = []
        for req in [r for r in self.running if r.rid in scheduled]:
            req.computed += scheduled[req.rid]
            if req.computed >= req.prompt_len:
                req.outputs += 1
                if req.outputs == 1:
                    self.send("first", req)
            if req.outputs == req.max_tokens:
                finished.append(req)
        for req in finished:  # `request_finished`, then its blocks freed, last first
            self.running.remove(req)
            out = side.finished(req.rid)
            result = ConnectorResult.from_json(out[RESULT_KEY]) if out is not None else None
            if result is not None:
                self.counts.overwrites += len(result.host_overwritten)
                self.counts.refused_tokens += result.overwritten_tokens
            self.log.append(f"{self.tick} finish {req.rid}")
            self.send("report", req, result)
            pool.free_blocks(reversed(req.blocks))
        side.on_worker_report(WorkerReport(host_written=written))  # after the finishes

    def scheduler_output(self, scheduled: dict[str, int]) -> Any:
        new_reqs: list[Any] = []
        cached = SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        )
        for req in self.running:
            if req.rid not in scheduled:
                continue
            ids, done = [b.block_id for b in req.blocks], req.computed
            if req.new:
                req.new = False
                new_reqs.append(
                    SimpleNamespace(req_id=req.rid, block_ids=[ids], num_computed_tokens=done)
                )
            else:
                sent = 0 if req.resumed else req.sent  # a resumed request: its whole list anew
                if req.resumed:
                    cached.resumed_req_ids.add(req.rid)
                req.resumed = False
                cached.req_ids.append(req.rid)
                cached.new_block_ids.append([ids[sent:]] if len(ids) > sent else None)
                cached.num_computed_tokens.append(done)
            req.sent = len(ids)
        return SimpleNamespace(
            num_scheduled_tokens=scheduled,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            has_sync_kv_loads=self.sync_loads,
        )

    def worker(self, step: StepOps, scheduled: dict[str, int], *, before_forward: bool) -> set[int]:
        """`start_load_kv` (the copies at hand-out, loads checked) and the forward pass, in
        vLLM's order: `start_load_kv` first only when `before_forward` (the step's
        `has_sync_kv_loads`); then the look-ahead's copies. The keys of the copies reported
        run."""
        written: set[int] = set()
        if before_forward:
            self.start_load_kv(step, written)
        self.forward(scheduled)
        if not before_forward:
            self.start_load_kv(step, written)
        self.copy_out(step.host_writes, written)
        return written

    def start_load_kv(self, step: StepOps, written: set[int]) -> None:
        s, requests = self.s, {r.rid: r for r in self.running}
        self.copy_out(step.handout_writes, written)
        self.counts.handout_copies += len(step.handout_writes)
        for ops in step.requests:
            req = requests[ops.req_id]
            plan = Plan.from_json(req.params[PLAN_KEY]) if req.params else None
            lease = plan.lease if plan is not None else None
            lent = {sl for _, slots in lease.victims for sl in slots} if lease else set()
            for index, span in enumerate(ops.load):
                lo = max(span.token_start, ops.load_lo)
                hi = min(span.token_start + span.num_tokens, ops.load_hi)
                if hi <= lo:
                    continue
                self.counts.host_loads += 1
                self.counts.host_tokens += hi - lo
                if plan is not None and index >= len(plan.load):
                    self.counts.copied_loads += 1
                if lent & set(span.slots):
                    self.counts.victim_loads += 1
                for pos in range(lo, hi):
                    rel = pos - span.token_start
                    slot, row = span.slots[rel // s.page], rel % s.page
                    got = self.host.get((slot, row))
                    if got != req.tokens[pos]:
                        self.fail(
                            f"{req.rid} loads position {pos} from host slot {slot} row {row}: "
                            f"holds {got}, the prompt has {req.tokens[pos]} (load span {index} "
                            f"of {list(ops.load)}, plan {_plan_str(plan)})"
                        )
                    self.paged[(ops.block_ids[pos // s.block], pos % s.block)] = got

    def forward(self, scheduled: dict[str, int]) -> None:
        """The step's forward pass: each scheduled token's KV into its block; a prefix-cache
        hit is checked to hold the prompt's KV."""
        s, requests = self.s, {r.rid: r for r in self.running}
        for rid, new in scheduled.items():
            req = requests[rid]
            for pos in range(req.computed, req.computed + new):
                self.paged[(req.blocks[pos // s.block].block_id, pos % s.block)] = req.tokens[pos]
        for rid in scheduled:
            req = requests[rid]
            for pos in range(req.hit):  # a prefix-cache hit holds the prompt's KV
                block = req.blocks[pos // s.block].block_id
                if self.paged.get((block, pos % s.block)) != req.tokens[pos]:
                    self.fail(f"{req.rid}: vLLM's prefix-cache hit is wrong at {pos}")
            req.hit = 0

    def copy_out(self, writes: Sequence[Any], written: set[int]) -> None:
        """Eviction-time copies, paged KV -> host slots, as the blocks hold it now; the keys
        of those reported run join `written`."""
        s = self.s
        for write in writes:
            for i in range(write.num_tokens):
                pos = write.token_start + i
                source = (write.block_ids[pos // s.block], pos % s.block)
                self.host[(write.slots[i // s.page], i % s.page)] = self.paged.get(source)
            if self.rng.random() < s.fail_copy:  # ran, reported failed: never to be read
                self.counts.failed_copies += 1
            else:
                written.add(write.key)
                self.counts.copies += 1


def _plan_str(plan: Plan | None) -> str:
    if plan is None:
        return "-"
    text = f"load={[(list(sp.slots), sp.token_start, sp.num_tokens) for sp in plan.load]} "
    text += f"keep={[(k.key, k.parent, k.token_start, k.num_tokens) for k in plan.keep]}"
    if (lease := plan.lease) is not None:
        text += f" lease=v{lease.version}/a{lease.applied} {list(lease.slots)}"
        text += f" victims={[(v, list(sl)) for v, sl in lease.victims]}"
    return text


def _report_str(result: ConnectorResult) -> str:
    copied = [(seq, key, list(slots)) for seq, key, slots in result.host_copied]
    return (
        f"copied={copied} overwritten={list(result.host_overwritten)} "
        f"dropped={list(result.host_dropped)} gone={list(result.host_gone)}"
    )
