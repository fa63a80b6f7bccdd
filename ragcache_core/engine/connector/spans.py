"""Plan checks and token-level index building (pure; torch only to hold the indices).

A plan reaches the connector from the app; the scheduler-side connector checks it once with
`plan_problems` and ignores a plan that fails (the request then runs uncached). The worker
turns each span into a `TokenIndex` with `span_index`:

    prompt positions   lo ......................... hi      (the part of the span to copy)
    span               |token_start ........ token_start + num_tokens|
    pool side          slot = slots[(p - token_start) // page_size], row = (p - token_start) % P
    paged side         block = block_ids[p // block_size],          offset = p % block_size
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragcache_core.capacity import slots_for_tokens
from ragcache_core.plan import Plan, Tier

if TYPE_CHECKING:
    import torch

    from ragcache_core.storage.copy.base import TokenIndex


def plan_problems(plan: Plan, *, prompt_len: int, page_size: int, host_slots: int) -> list[str]:
    """Everything wrong with `plan` for a prompt of `prompt_len` tokens (empty when valid).

    Valid means: the pools' page size; loads are contiguous from position 0; every span's
    slot count matches its tokens; every slot is inside the host pool; stores lie in the
    prompt; keep spans lie in the prompt in order (a keep span's parent is an earlier one);
    lease slots (free and victims') are in the host pool, once each, and every victim holds
    some. The engine has no GPU pool (its GPU tier is vLLM's own KV cache), so a GPU load or
    store is refused (the tree never plans one).
    """
    problems: list[str] = []

    def check_slots(what: str, slots: Sequence[int], tier: Tier) -> None:
        if tier is not Tier.HOST:
            problems.append(
                f"{what} uses the {tier} pool: the engine has none (vLLM's own KV cache is "
                "the GPU tier)"
            )
            return
        bad = [s for s in slots if not 0 <= s < host_slots]
        if bad and not host_slots:
            problems.append(f"{what}: the engine has no host pool (host_pool_tokens=0)")
        elif bad:
            problems.append(
                f"{what}: host slot(s) {bad[:4]} outside the pool (0..{host_slots - 1})"
            )

    if plan.page_size != page_size:
        problems.append(f"plan page size {plan.page_size} != pool page size {page_size}")
        return problems
    position = 0
    for i, load in enumerate(plan.load):
        if load.token_start != position:
            problems.append(f"load[{i}] starts at {load.token_start}, expected {position}")
        if load.num_tokens <= 0 or len(load.slots) != slots_for_tokens(load.num_tokens, page_size):
            problems.append(
                f"load[{i}]: {len(load.slots)} slots for {load.num_tokens} tokens "
                f"(page size {page_size})"
            )
        check_slots(f"load[{i}]", load.slots, load.tier)
        position = load.token_start + load.num_tokens
    if position > prompt_len:
        problems.append(f"loads cover {position} tokens, the prompt has {prompt_len}")
    for i, store in enumerate(plan.store):
        end = store.token_start + store.num_tokens
        if store.token_start < 0 or store.num_tokens <= 0 or end > prompt_len:
            problems.append(
                f"store[{i}] covers [{store.token_start}, {end}) outside the prompt "
                f"[0, {prompt_len})"
            )
        if len(store.slots) != slots_for_tokens(store.num_tokens, page_size):
            problems.append(
                f"store[{i}]: {len(store.slots)} slots for {store.num_tokens} tokens "
                f"(page size {page_size})"
            )
        check_slots(f"store[{i}]", store.slots, store.tier)
    position = 0
    keys: set[int] = set()
    for i, keep in enumerate(plan.keep):
        end = keep.token_start + keep.num_tokens
        if keep.key < 0 or keep.token_start < position or keep.num_tokens <= 0 or end > prompt_len:
            problems.append(
                f"keep[{i}] (key {keep.key}) covers [{keep.token_start}, {end}): keep spans lie "
                f"in the prompt [0, {prompt_len}) in order, non-empty, with non-negative keys"
            )
        if keep.parent is not None and keep.parent not in keys:
            problems.append(f"keep[{i}] names parent {keep.parent}, not an earlier keep span")
        keys.add(keep.key)
        position = max(position, end)
    if len(keys) != len(plan.keep):
        problems.append("keep spans repeat a key")
    if plan.keep and plan.store:
        problems.append("a plan writes the host tier at compute (store) or at eviction (keep)")
    if plan.lease is not None:
        check_slots("lease", plan.lease.slots, Tier.HOST)
        victim_slots = [slot for _, slots in plan.lease.victims for slot in slots]
        check_slots("lease victims", victim_slots, Tier.HOST)
        lent = [*plan.lease.slots, *victim_slots]
        if len(set(lent)) != len(lent):
            problems.append("the lease repeats a host slot")
        if len({vid for vid, _ in plan.lease.victims}) != len(plan.lease.victims):
            problems.append("the lease repeats a victim")
        if any(not slots for _, slots in plan.lease.victims):
            problems.append("the lease lends a victim of no slots (its overwrite frees nothing)")
    return problems


@dataclass(frozen=True, slots=True)
class SpanRef:
    """The part [lo, hi) of one plan span to copy, with the request's vLLM block ids."""

    slots: Sequence[int]
    token_start: int
    num_tokens: int
    lo: int
    hi: int
    block_ids: Sequence[int]

    @property
    def first(self) -> int:
        return max(self.token_start, self.lo)

    @property
    def last(self) -> int:
        return min(self.token_start + self.num_tokens, self.hi)


def step_index(
    spans: Sequence[SpanRef], *, block_size: int, page_size: int, device: torch.device
) -> TokenIndex:
    """One `TokenIndex` for every span of a step (all requests), built with a fixed number of
    tensor operations whatever the number of spans, so that each copy then runs once per
    layer for the whole step (not once per span and layer).

    Raises `IndexError` if a position has no block in its request's `block_ids`.
    """
    import torch

    from ragcache_core.storage.copy.base import TokenIndex

    live = [s for s in spans if s.last > s.first]
    if not live:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return TokenIndex(empty, empty, empty)
    slot_table: list[int] = []
    block_table: list[int] = []
    slot_base, block_base, lengths, firsts, starts = [], [], [], [], []
    tables: dict[int, int] = {}  # id(block_ids) -> offset: requests share one block list
    for span in live:
        if (span.last - 1) // block_size >= len(span.block_ids):
            raise IndexError(
                f"position {span.last - 1} has no block "
                f"(request holds {len(span.block_ids)} blocks)"
            )
        slot_base.append(len(slot_table))
        slot_table.extend(span.slots)
        key = id(span.block_ids)
        if key not in tables:
            tables[key] = len(block_table)
            block_table.extend(span.block_ids)
        block_base.append(tables[key])
        lengths.append(span.last - span.first)
        firsts.append(span.first)
        starts.append(span.token_start)
    counts = torch.tensor(lengths, dtype=torch.long)  # [S]
    span_of = torch.repeat_interleave(torch.arange(len(live)), counts)  # [T]
    begin = torch.cumsum(counts, 0) - counts  # [S]: first row of each span
    positions = (  # [T]: prompt positions
        torch.arange(int(counts.sum())) - begin[span_of] + torch.tensor(firsts)[span_of]
    )
    relative = positions - torch.tensor(starts)[span_of]  # [T]: position inside the span
    pages = torch.tensor(slot_table, dtype=torch.long)[
        torch.tensor(slot_base)[span_of] + relative // page_size
    ]  # [T]
    blocks = torch.tensor(block_table, dtype=torch.long)[
        torch.tensor(block_base)[span_of] + positions // block_size
    ]  # [T]
    return TokenIndex(
        pool_slots=pages.to(device),
        pool_rows=(relative % page_size).to(device),
        slot_mapping=(blocks * block_size + positions % block_size).to(device),
    )


def span_index(
    *,
    slots: Sequence[int],
    token_start: int,
    num_tokens: int,
    lo: int,
    hi: int,
    block_ids: Sequence[int],
    block_size: int,
    page_size: int,
    device: torch.device,
) -> TokenIndex:
    """The rows of span [token_start, token_start + num_tokens) that fall in [lo, hi).

    Raises `IndexError` if a position has no block in `block_ids`.
    """
    span = SpanRef(slots, token_start, num_tokens, lo, hi, block_ids)
    return step_index([span], block_size=block_size, page_size=page_size, device=device)
