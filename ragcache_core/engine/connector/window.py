"""The eviction window: eviction-time host writes, scheduler side (docs/design.md 2.2).

With `CacheConfig.host_write="eviction"` plans carry `KeepSpan`s (documents the tree wants on
the host tier) and a `HostLease` (host slots lent for copies) instead of store spans. A kept
document is copied to the host tier when vLLM hands one of its blocks out for other tokens
(vLLM's reuse hook), so no step, however many blocks it takes, lets one go uncopied while the
lease has room:

    finish(request)  record each keep span's blocks and their block hashes (all must be in
                     vLLM's prefix cache), and watch them (`BlockPool.unpin_blocks` with a
                     reuse callback: the block pool names each block it hands out, before it
                     drops the block's hash); an aborted request records nothing
    on_reuse(block)  (during scheduling) a block of a recorded, uncopied document is being
                     handed out: the document is copied in this step
    step_writes()    (the step's metadata) the documents handed out this step, each with its
                     uncopied recorded ancestors (a host copy needs its parent's), get leased
                     slots (free lent ones, then the lease's victims: host copies the tree
                     lent, least wanted first, never one a load of this step reads); the worker
                     copies them first in the step, before its loads and its forward pass write
                     into the blocks handed out. Without room even then a document is let go
                     (`no_lease`)
                     With a look-ahead (`window_blocks` > 0) it also walks the first
                     `window_blocks` of vLLM's free queue (head = next handed out) and
                     copies the recorded documents there ahead of their hand-out, their
                     blocks held (`touch`) until the step's report; those copies run after
                     the forward pass
    load_limit()     a plan's loads end before the first span that reads a victim overwritten
                     before the plan's tree heard of it (by number, or the plan still lends
                     it): vLLM computes the rest, exactly
    copied_loads()   a plan's keep spans right after its loads that the window copied and the
                     tree has not applied yet (it planned them computed): loaded from those
                     copies instead, whose slots are still the engine's own
    on_report()      the step's worker report: held blocks go back (`free_blocks`), copies
                     that ran are numbered and queued for the tree, failed ones give their
                     slots back to the lease and are dropped
    take_changes()   what the next report of any request carries to the tree, once each:
                     copies done, victims overwritten (`take_overwritten`), keys dropped,
                     and the recorded documents whose blocks left vLLM's cache (or that it
                     stopped following) since the last call; a record lives, copied or not,
                     until its blocks leave vLLM's cache, so the tree knows which documents
                     vLLM's blocks hold (`Node.resident`)

Blocks are held only between `step_writes` and the same step's `on_report`; a block found
still held at the next `step_writes` (no report came) is handed back and counted
(`stranded_blocks`). Pure Python over vLLM's `BlockPool` and `KVCacheBlock`s; mutated only by
vLLM's scheduler thread. It imports no vLLM module, so `ragcache simulate` runs this
same window over its own copy of vLLM's block pool (`sim.blocks`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ragcache_core.capacity import slots_for_tokens
from ragcache_core.plan import HostLease, KeepSpan, LoadSpan, Plan, Tier, WindowLosses

logger = logging.getLogger(__name__)

HOST_HELD_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class HostWrite:
    """An eviction-time copy: tokens [token_start, token_start + num_tokens) of the blocks
    `block_ids` (token t in block `block_ids[t // block_size]`) -> host `slots`. A copy at
    hand-out runs before the step's loads and forward pass (some of its blocks are being handed
    out); a look-ahead copy runs after the forward pass, its blocks held by the scheduler side
    until the step's report. `fail`, `kill`: test hooks, the copy runs and is then reported
    failed, or the worker dies in the step's copies (`config.FAULT_KEY`)."""

    key: int
    block_ids: tuple[int, ...]
    token_start: int
    num_tokens: int
    slots: tuple[int, ...]
    fail: bool = False
    kill: bool = False


@dataclass(slots=True)
class _Record:
    """A kept document as vLLM's blocks hold it: the blocks of its tokens, the hashes they had
    when recorded, its tokens' offset in its first block."""

    key: int
    parent: int | None
    blocks: list[Any]
    hashes: list[Any]
    token_start: int
    num_tokens: int
    fail: bool
    version: int
    """The plan (lease version) that recorded it: named in its gone report."""
    copied: int = 0
    """The copy's sequence number (0: not copied)."""
    refused: bool = False
    """A scan found it (or a descendant) in the window with no lease room for its copy."""
    kill: bool = False
    """Test hook (`config.FAULT_KEY`): the worker dies in the step that copies it."""

    def intact(self) -> bool:
        """Every block still holds the KV it was recorded with (vLLM resets a block's hash when
        it evicts it; a block's hash names its tokens and its whole prefix)."""
        return all(b.block_hash == h for b, h in zip(self.blocks, self.hashes, strict=True))

    def whole(self, reused: set[int]) -> bool:
        """Every block holds the KV it was recorded with, or was handed out in this step
        (`reused`: its hash is gone, its KV stays until the step's worker writes it)."""
        return all(
            b.block_hash == h or b.block_id in reused
            for b, h in zip(self.blocks, self.hashes, strict=True)
        )


class EvictionWindow:
    """Records, the lease and the copies in flight (see the module docstring)."""

    def __init__(
        self,
        *,
        window_blocks: int,
        block_size: int,
        page_size: int,
        back_to_head: bool = False,
        handout: bool = True,
    ) -> None:
        self.window_blocks = window_blocks
        self.handout = handout
        """Copy a kept document when vLLM hands one of its blocks out (False: only what the
        look-ahead sees, as vLLM's own lazy offload does; what a step takes from beyond it is
        lost)."""
        self.back_to_head = back_to_head
        """Where held blocks that were in the window go back: False, the queue's tail
        (`free_blocks`, as vLLM's lazy offload does: a copied document gets a second turn in
        vLLM's LRU); True, the head, in their order (`compat.requeue_at_head`: vLLM's LRU order
        as if nothing had held them, so a copied document leaves vLLM's blocks next)."""
        self._requeue: list[Any] = []
        """Held blocks that were in the window when held, in queue order."""
        self.block_size = block_size
        self.page_size = page_size
        self._records: dict[int, _Record] = {}
        self._by_block: dict[int, set[int]] = {}
        """vLLM block id -> keys of the uncopied records holding it."""
        self._epoch: int | None = None
        self._lease_version = -1
        self._lease_set: set[int] = set()
        self._lease: list[int] = []
        """Leased slots free for a copy."""
        self._victims: list[tuple[int, tuple[int, ...]]] = []
        """The lease's victims not overwritten yet, least wanted first: (victim id, slots)."""
        self._overwrites: list[tuple[int, int]] = []
        """Victims overwritten that no lease acknowledged yet (`HostLease.applied`): (sequence
        number, victim id), in every report until one does (a lost report loses nothing)."""
        self._dirty: dict[int, tuple[int, int]] = {}
        """Host slot -> (sequence number, victim id) of the last victim overwrite that took
        it: a plan made before the tree applied that number, or whose lease still lists that
        victim (its report was lost or is late), must not load from it (`load_limit`); a
        victim a lease lists with one of its slots here is known overwritten (never lent
        again as a victim: its slots are free lent ones)."""
        self._consumed: dict[int, tuple[int, ...]] = {}
        """Copies done that the tree has not applied yet: sequence number -> slots."""
        self._seq = 0
        self._copying: dict[int, tuple[_Record, tuple[int, ...], bool]] = {}
        """Copies in flight (this step): key -> (record, slots, held): a look-ahead copy's
        blocks are held (`touch`) until the report; a copy at hand-out holds none (its blocks
        belong to the requests vLLM handed them to)."""
        self._handed: dict[int, None] = {}
        """Keys of uncopied records one of whose blocks vLLM handed out while scheduling this
        step (`_on_reuse`), in order: copied in this step (`step_writes`)."""
        self._reused: set[int] = set()
        """Block ids vLLM handed out while scheduling this step."""
        self._copied: list[tuple[int, int, tuple[int, ...]]] = []
        """Copies done that no lease acknowledged yet: (sequence number, key, slots), in every
        report until one does (the tree applies each once, by number)."""
        self._dropped: list[int] = []
        self._gone: list[tuple[int, int]] = []
        self._host_held: OrderedDict[int, int] = OrderedDict()
        """Keys copied whose records left (their blocks left vLLM's cache) -> the copy's
        sequence number: a child's copy may still follow them (their host copy is there);
        bounded by `HOST_HELD_LIMIT`."""
        self.stranded_blocks = 0
        """Blocks found held with no copy in flight (handed back), since start."""
        self._losses = [0, 0, 0, 0]
        """Since the last `take_losses`: missed, no_lease, broken, unapplied
        (`WindowLosses`)."""

    # ------------------------------------------------------------------ reads

    @property
    def held_blocks(self) -> int:
        """Block references held for look-ahead copies in flight."""
        return sum(len(record.blocks) for record, _, held in self._copying.values() if held)

    # ------------------------------------------------------------------ from plans and finishes

    def take_lease(self, lease: HostLease) -> None:
        """A plan's lease, if newer than the one held: its slots less those consumed by copies
        the tree has not applied (`lease.applied`) and those of copies in flight. A lease of
        another epoch (another tree) starts afresh: every record and change of the previous
        one is forgotten (called between steps: no copy is in flight)."""
        if lease.epoch != self._epoch:
            self._epoch, self._lease_version = lease.epoch, -1
            self._records, self._by_block, self._consumed = {}, {}, {}
            self._copied, self._dropped, self._gone, self._seq = [], [], [], 0
            self._host_held = OrderedDict()
            self._overwrites, self._dirty = [], {}
        if lease.version <= self._lease_version:
            return
        self._lease_version = lease.version
        for seq in [s for s in self._consumed if s <= lease.applied]:
            del self._consumed[seq]
        self._copied = [c for c in self._copied if c[0] > lease.applied]
        self._overwrites = [o for o in self._overwrites if o[0] > lease.applied]
        busy = {slot for slots in self._consumed.values() for slot in slots}
        busy.update(slot for _, slots, _ in self._copying.values() for slot in slots)
        lent = list(lease.slots)
        self._victims = []
        for vid, slots in lease.victims:
            if self._overwrote(vid, slots):  # the tree has not heard yet: its slots are lent
                lent.extend(slots)
            else:
                self._victims.append((vid, slots))
        self._lease_set = set(lent)
        self._lease = [slot for slot in lent if slot not in busy]

    def record(
        self,
        keep: tuple[KeepSpan, ...],
        block_ids: list[int],
        block_pool: Any,
        *,
        epoch: int,
        version: int,
        fail: bool = False,
        kill: bool = False,
    ) -> None:
        """A request finished with its prompt computed: record its keep spans' blocks, in
        prompt order, until one is not wholly in vLLM's prefix cache (its children could not be
        copied below it; those spans are reported gone), and watch the blocks of each record
        not copied yet: vLLM calls `_on_reuse` as it hands one out (`unpin_blocks` after a
        `touch`: a reference taken and given back, the block in use by the finishing request
        meanwhile, so its place in vLLM's free queue does not change). A record being copied
        now is left alone; a plan of another epoch than the lease's (an earlier tree's) records
        nothing. `version`: the plan's lease version."""
        if epoch != self._epoch:
            return
        size = self.block_size
        for index, span in enumerate(keep):
            first, end = span.token_start // size, -(-(span.token_start + span.num_tokens) // size)
            blocks = (
                [block_pool.blocks[block_ids[i]] for i in range(first, end)]
                if end <= len(block_ids)
                else []
            )
            if not blocks or any(block.block_hash is None for block in blocks):
                self.unfollowed(keep[index:], epoch=epoch, version=version)
                return
            if span.key in self._copying:
                continue
            copied = self._unapplied_copy(span.key)
            self._forget(span.key)
            record = _Record(
                key=span.key,
                parent=span.parent,
                blocks=blocks,
                hashes=[block.block_hash for block in blocks],
                token_start=span.token_start - first * size,
                num_tokens=span.num_tokens,
                fail=fail,
                version=version,
                kill=kill,
                copied=copied,
            )
            self._records[span.key] = record
            if copied:  # on the host already (the tree has not heard yet): never copied again
                continue
            for block in blocks:
                self._by_block.setdefault(block.block_id, set()).add(span.key)
            if self.handout:
                block_pool.touch(blocks)
                block_pool.unpin_blocks(blocks, self._on_reuse)

    # ------------------------------------------------------------------ every step

    def step_writes(
        self, block_pool: Any, reading: frozenset[int] = frozenset()
    ) -> tuple[list[HostWrite], list[HostWrite]]:
        """This step's host writes, once per step after vLLM scheduled it: (at hand-out, run
        before the step's loads and forward pass; look-ahead, run after the forward pass).
        `reading`: the host slots this step's loads read (no victim holding one is overwritten
        by a copy that runs before them)."""
        self._hand_back_stranded(block_pool)
        handed = self._handout(reading)
        return handed, self._look_ahead(block_pool)

    def _on_reuse(self, block: Any) -> None:
        """vLLM's reuse callback (`BlockPool.get_new_blocks`, while it schedules a step): it
        hands `block` out for other tokens, its hash still set (dropped right after), its KV
        unchanged until the step runs. Every uncopied record holding it is copied in this
        step. Also called for every watched block when vLLM's prefix cache is reset (before
        the connector's `reset`, which forgets what this marks)."""
        self._reused.add(block.block_id)
        for key in sorted(self._by_block.get(block.block_id, ())):
            self._handed.setdefault(key, None)

    def _handout(self, reading: frozenset[int]) -> list[HostWrite]:
        """The copies of the records vLLM handed blocks of out while scheduling this step,
        each with its uncopied recorded ancestors, into lent slots; without room a record is
        let go (counted `no_lease` as its blocks leave)."""
        handed, self._handed = list(self._handed), {}
        reused, self._reused = self._reused, set()
        chosen: list[tuple[_Record, tuple[int, ...]]] = []
        taken: set[int] = set(self._copying)
        for key in handed:
            record = self._records.get(key)
            if record is None or record.copied or key in taken:
                continue
            chain = self._chain(record, taken, reused)
            if chain is None:  # an ancestor left vLLM's blocks uncopied: no copy below it
                self._losses[2] += 1
                self._drop(key)
                continue
            took = self._take(
                [slots_for_tokens(r.num_tokens, self.page_size) for r in chain], reading
            )
            if took is None:
                for member in chain:
                    member.refused = True
                continue  # its blocks leave vLLM's cache now: counted as they are swept
            for member, slots in zip(chain, took, strict=True):
                chosen.append((member, slots))
                taken.add(member.key)
        for record, slots in chosen:
            self._copying[record.key] = (record, slots, False)
        return [_write(record, slots) for record, slots in chosen]

    def _look_ahead(self, block_pool: Any) -> list[HostWrite]:
        """The recorded documents at the head of vLLM's free queue (the next handed out) that
        the lease has room for, with their blocks held now (`touch`); none without a window."""
        if not self._records or self.window_blocks <= 0:
            return []
        chosen: list[tuple[_Record, tuple[int, ...]]] = []
        taken: set[int] = set(self._copying)
        queue = block_pool.free_block_queue
        in_window: list[Any] = []
        for seen, block in enumerate(queue.iter_blocks_after(None)):
            if seen >= self.window_blocks:
                break
            in_window.append(block)
            for key in sorted(self._by_block.get(block.block_id, ())):
                record = self._records.get(key)
                if record is None or record.copied or key in taken:
                    continue
                if not record.intact():  # a step took some of its blocks and it found no room
                    self._lose(record)
                    self._drop(key)
                    continue
                chain = self._chain(record, taken, set())
                if chain is None:  # an ancestor's copy is impossible: so is its own
                    self._losses[2] += 1
                    self._drop(key)
                    continue
                took = self._take([slots_for_tokens(r.num_tokens, self.page_size) for r in chain])
                if took is None:
                    for member in chain:
                        member.refused = True
                    continue  # let go: vLLM's LRU takes it unless a later lease has room
                for member, slots in zip(chain, took, strict=True):
                    chosen.append((member, slots))
                    taken.add(member.key)
        held = {id(b) for record, _ in chosen for b in record.blocks}
        self._requeue = [b for b in in_window if id(b) in held]
        for record, slots in chosen:  # touch after the walk: it unlinks blocks from the queue
            block_pool.touch(record.blocks)
            self._copying[record.key] = (record, slots, True)
        return [_write(record, slots) for record, slots in chosen]

    def on_report(self, written: set[int], block_pool: Any) -> None:
        """The step's worker report (`written`: keys of the host writes that ran; a step with
        no report ran none): hand every held block back, number the copies done, give the
        failed ones' slots back to the lease. A copy at hand-out read its blocks before the
        step wrote them: done when it ran, although they no longer hold the document."""
        copying, self._copying = self._copying, {}
        requeue, self._requeue = self._requeue, []
        for key, (record, slots, held) in copying.items():
            if held:
                block_pool.free_blocks(record.blocks)
            if key in written and (not held or record.intact()):
                self._seq += 1
                self._consumed[self._seq] = slots
                self._copied.append((self._seq, key, slots))
                record.copied = self._seq
                self._unindex(record)
            else:
                self._lease.extend(s for s in slots if s in self._lease_set)
                self._drop(key)
        if self.back_to_head and requeue:
            from ragcache_core.engine.compat import requeue_at_head

            requeue_at_head(block_pool, requeue)

    def load_limit(self, plan: Plan) -> int | None:
        """Where `plan`'s loads must end: the start of its first load span that reads a slot
        of a victim overwritten before the plan's tree heard of it: the overwrite is numbered
        above `lease.applied`, or the plan's lease still lists that victim (the tree applied
        later numbers: its report was lost, or comes late). None when none does. Called as
        vLLM asks how many tokens the connector loads; the step's loads run before its forward
        pass and the window's copies after it, so a load accepted before the overwrite reads
        the victim whole."""
        lease = plan.lease
        if not self._dirty or lease is None or lease.epoch != self._epoch:
            return None
        listed = {vid for vid, _ in lease.victims}
        for span in plan.load:
            for slot in span.slots:
                seq, vid = self._dirty.get(slot, (0, 0))
                if seq > lease.applied or vid in listed:
                    return span.token_start
        return None

    def copied_loads(self, plan: Plan, start: int) -> tuple[LoadSpan, ...]:
        """Load spans for `plan`'s keep spans from prompt position `start` on, in order and
        each right after the last, whose documents the window copied after the tree last
        applied a copy (`lease.applied`): the tree planned them computed (its plan keeps them)
        although the host holds them. Their slots are the engine's own until the tree applies
        the copy (no lease hands them out: `take_lease` counts them busy), so they read whole.
        Empty for a plan of another epoch."""
        lease = plan.lease
        if lease is None or lease.epoch != self._epoch or not self._consumed:
            return ()
        spans: list[LoadSpan] = []
        position = start
        for span in plan.keep:
            if span.token_start != position:
                break
            slots = self._consumed.get(self._unapplied_copy(span.key))
            if slots is None or len(slots) != slots_for_tokens(span.num_tokens, self.page_size):
                break
            spans.append(LoadSpan(Tier.HOST, slots, span.token_start, span.num_tokens))
            position += span.num_tokens
        return tuple(spans)

    def take_overwritten(self) -> tuple[tuple[int, int], ...]:
        """Victims overwritten that no lease acknowledged yet (sequence number, victim id),
        for the same report as `take_changes`: the tree applies them in number order with the
        copies, so a victim leaves before a copy onto its slots lands."""
        return tuple(self._overwrites)

    def unfollowed(self, keep: tuple[KeepSpan, ...], *, epoch: int, version: int) -> None:
        """A finished request's keep spans that are not recorded (it was aborted, or its blocks
        are not all in vLLM's prefix cache): reported gone, so the tree that counted them as in
        vLLM's blocks at its first token stops (a recording by a later plan stands)."""
        if epoch == self._epoch:
            self._gone.extend((span.key, version) for span in keep)

    def take_changes(
        self,
    ) -> tuple[
        tuple[tuple[int, int, tuple[int, ...]], ...], tuple[int, ...], tuple[tuple[int, int], ...]
    ]:
        """Copies done that no lease acknowledged yet (every report carries them until the
        tree's `applied` passes them: a report vLLM drops loses none), keys dropped and
        records gone since the last call (for one report). Records whose blocks left vLLM's
        cache are found here (`_sweep`)."""
        self._sweep()
        copied = tuple(self._copied)
        dropped, self._dropped = tuple(self._dropped), []
        gone, self._gone = tuple(self._gone), []
        return copied, dropped, gone

    def take_losses(self) -> WindowLosses:
        """The kept documents that left vLLM's cache uncopied since the last call (for one
        report, after `take_changes`, whose sweep finds them)."""
        losses, self._losses = WindowLosses(*self._losses), [0, 0, 0, 0]
        return losses

    def planned(self, keep: tuple[KeepSpan, ...], lease: HostLease) -> None:
        """A plan reached the engine: each document it keeps (so computes or reads from
        vLLM's blocks) that the window copied after the tree last applied a copy
        (`lease.applied`), and whose blocks have left vLLM's cache, is computed although the
        host holds it: the tree had not heard of the copy (`WindowLosses.unapplied`)."""
        if lease.epoch != self._epoch:
            return
        for span in keep:
            record = self._records.get(span.key)
            if record is not None:
                seq = record.copied if not record.intact() else 0
            else:
                seq = self._host_held.get(span.key, 0)
            if seq > lease.applied:
                self._losses[3] += 1

    def reset(self, block_pool: Any) -> None:
        """vLLM's prefix cache was reset (`clear()`): forget every record; blocks held (none
        between steps) go back, their slots to the lease. The lease itself stays."""
        self.on_report(set(), block_pool)
        for key in sorted(self._records):
            self._drop(key)
        self._host_held.clear()
        self._handed, self._reused = {}, set()

    # ------------------------------------------------------------------ internals

    def _overwrote(self, vid: int, slots: tuple[int, ...]) -> bool:
        """Whether this engine overwrote victim `vid` (of `slots`), as far as its slots say:
        no other victim can own them while the tree still lends `vid`."""
        return any(self._dirty.get(slot, (0, 0))[1] == vid for slot in slots)

    def _unapplied_copy(self, key: int) -> int:
        """The sequence number of the copy of `key` the tree has not applied yet (0: none)."""
        record = self._records.get(key)
        seq = record.copied if record is not None else self._host_held.get(key, 0)
        return seq if seq in self._consumed else 0

    def _take(
        self, counts: list[int], reading: frozenset[int] = frozenset()
    ) -> list[tuple[int, ...]] | None:
        """Lent slots for copies of `counts` slots each: free ones first, then the lease's
        victims, least wanted first, overwritten while the free ones fall short; None, and
        nothing taken, when even all of them would not do. No slot in `reading` is taken (the
        slots this step's loads read, for copies that run before them): a victim holding one
        is passed over, and so is a free lent slot (a newer lease taken in this step can free
        the slots of a copy that a load accepted earlier in the step reads:
        `copied_loads`)."""
        need = sum(counts)
        free = [slot for slot in self._lease if slot not in reading]
        usable = [v for v in self._victims if reading.isdisjoint(v[1])]
        if need > len(free) + sum(len(slots) for _, slots in usable):
            return None
        while len(free) < need:
            victim = usable.pop(0)
            self._victims.remove(victim)
            vid, slots = victim
            self._seq += 1
            self._overwrites.append((self._seq, vid))
            for slot in slots:
                self._dirty[slot] = (self._seq, vid)
            self._lease_set.update(slots)
            self._lease.extend(slots)
            free.extend(slots)
        took = set(free[:need])
        self._lease = [slot for slot in self._lease if slot not in took]
        out, start = [], 0
        for count in counts:
            out.append(tuple(free[start : start + count]))
            start += count
        return out

    def _chain(self, record: _Record, taken: set[int], reused: set[int]) -> list[_Record] | None:
        """`record` and its uncopied recorded ancestors, root first; None if one is gone or
        no longer whole (`_Record.whole`: its copy is impossible, so is the child's)."""
        chain: list[_Record] = []
        current: _Record | None = record
        while current is not None:
            if not current.whole(reused):
                return None
            chain.append(current)
            parent = current.parent
            if parent is None:
                break
            current = self._records.get(parent)
            if current is None:
                if parent in self._host_held:
                    break  # copied, then its blocks left vLLM's cache: its host copy stays
                return None
            if current.copied or parent in taken:
                break
        chain.reverse()
        return chain

    def _hand_back_stranded(self, block_pool: Any) -> None:
        """Copies still in flight at the next step: the last step's report never came (a
        bug): held blocks go back (counted), the copies count as not run."""
        if not self._copying:
            return
        held = self.held_blocks
        logger.error(
            "RAGCache: %d copies with no report (%d blocks held); handing them back",
            len(self._copying),
            held,
        )
        self.stranded_blocks += held
        self.on_report(set(), block_pool)

    def _sweep(self) -> None:
        """Every record (none being copied, none handed out for a step not built yet) whose
        blocks left vLLM's cache is gone: forgotten and reported; a copied one is remembered as
        held on the host for its children's copies. O(recorded blocks): about vLLM's cached
        blocks of kept documents."""
        for key, record in list(self._records.items()):
            if key in self._copying or key in self._handed or record.intact():
                continue
            self._forget(key)
            self._gone.append((key, record.version))
            if record.copied:
                self._host_held[key] = record.copied
                if len(self._host_held) > HOST_HELD_LIMIT:
                    self._host_held.popitem(last=False)
            else:
                self._lose(record)

    def _lose(self, record: _Record) -> None:
        """`record`, a document the policy wanted on the host, left vLLM's cache uncopied:
        counted as refused a lease if the window ever refused it, else as missed."""
        self._losses[1 if record.refused else 0] += 1

    def _drop(self, key: int) -> None:
        record = self._forget(key)
        if record is not None:
            self._dropped.append(key)
            self._gone.append((key, record.version))

    def _forget(self, key: int) -> _Record | None:
        record = self._records.pop(key, None)
        if record is None:
            return None
        self._unindex(record)
        return record

    def _unindex(self, record: _Record) -> None:
        for block in record.blocks:
            keys = self._by_block.get(block.block_id)
            if keys is not None:
                keys.discard(record.key)
                if not keys:
                    del self._by_block[block.block_id]


def _write(record: _Record, slots: tuple[int, ...]) -> HostWrite:
    return HostWrite(
        key=record.key,
        block_ids=tuple(b.block_id for b in record.blocks),
        token_start=record.token_start,
        num_tokens=record.num_tokens,
        slots=slots,
        fail=record.fail,
        kill=record.kill,
    )
