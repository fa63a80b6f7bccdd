"""vLLM's GPU tier as the simulator models it: a pool of prefix-cached blocks under LRU.

A pure-Python copy of the parts of vLLM 0.32's `BlockPool` and `FreeKVCacheBlockQueue`
(`vllm/v1/core/block_pool.py`, `kv_cache_utils.py`) that decide what stays cached:

  * a block holds `block_size` tokens; a full block is cached under a hash chained on its
    prefix (`BlockHasher`: the same tokens after a different prefix are another block);
  * free blocks wait in one queue, head = next to be reused: `get_new_blocks` takes from the
    head, calls the reuse callback registered for the block (`unpin_blocks`) and evicts the
    block's hash; `free_blocks` puts blocks with a hash at the tail (LRU) and blocks without one
    at the head; `touch` (a hit) takes a free block out of the queue;
  * block 0 is vLLM's null block, never handed out.

The engine's eviction window (`engine.connector.window.EvictionWindow`) runs over this pool
unchanged: it uses the same names (`blocks`, `free_block_queue.iter_blocks_after`, `remove`,
`prepend_n`, `touch`, `free_blocks`, `unpin_blocks`, a block's `block_hash`, `ref_cnt`,
`prev_free_block`).
tests/test_sim_engine.py replays random operations on this pool and on vLLM's own and
compares them. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from ragcache_core.errors import ConfigError


class Block:
    """One block: its id, the hash of the tokens it caches (None: not cached), references."""

    __slots__ = ("block_hash", "block_id", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash: int | None = None
        self.ref_cnt = 0
        self.prev_free_block: Block | None = None
        self.next_free_block: Block | None = None


class FreeQueue:
    """vLLM's doubly linked free-block queue (head = evicted first), with sentinels."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head, self._tail = Block(-1), Block(-2)
        self._head.next_free_block, self._tail.prev_free_block = self._tail, self._head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def popleft(self) -> Block:
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            last = self._tail.prev_free_block
            assert last is not None
            block.prev_free_block, block.next_free_block = last, self._tail
            last.next_free_block = self._tail.prev_free_block = block
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[Block]) -> None:
        """Put `blocks` at the head, in their order (the first becomes the head)."""
        for block in reversed(blocks):
            first = self._head.next_free_block
            assert first is not None
            block.prev_free_block, block.next_free_block = self._head, first
            self._head.next_free_block = first.prev_free_block = block
        self.num_free_blocks += len(blocks)

    def iter_blocks_after(self, cursor: Block | None) -> Iterator[Block]:
        """Free blocks in eviction order after `cursor` (None: from the head)."""
        block = (self._head if cursor is None else cursor).next_free_block
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free_block


class BlockPool:
    """`num_blocks` blocks (block 0 is the null block: `num_blocks - 1` usable), all free and
    uncached at first. `evictions` counts cached blocks reused for other tokens."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ConfigError(f"vLLM's block pool needs at least 2 blocks, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_queue = FreeQueue(self.blocks)
        self.free_block_queue.popleft()  # the null block, as vLLM's pool takes it
        self.cached: dict[int, dict[int, Block]] = {}
        """Block hash -> the blocks caching it (vLLM allows one hash in several blocks)."""
        self.evictions = 0
        self._reuse_watchers: dict[int, Callable[[Block], None]] = {}
        """Block id -> the callback called once when the block is handed out (or reset)."""

    @property
    def num_free(self) -> int:
        return self.free_block_queue.num_free_blocks

    def longest_hit(self, hashes: Sequence[int]) -> list[Block]:
        """The cached blocks of the longest prefix of `hashes` (vLLM's
        `find_longest_cache_hit`; the caller caps `hashes` at the hit it may use)."""
        hit: list[Block] = []
        for block_hash in hashes:
            holders = self.cached.get(block_hash)
            if not holders:
                break
            hit.append(next(iter(holders.values())))
        return hit

    def touch(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, count: int) -> list[Block]:
        """`count` blocks from the head of the free queue, their hashes evicted. Raises
        `ValueError` when fewer are free (the caller sized the pool too small)."""
        if count > self.num_free:
            raise ValueError(f"cannot get {count} free blocks, {self.num_free} are free")
        taken = [self.free_block_queue.popleft() for _ in range(count)]
        self._notify_reuse(taken)
        for block in taken:
            self._evict(block)
            block.ref_cnt = 1
        return taken

    def unpin_blocks(self, blocks: Iterable[Block], on_reuse: Callable[[Block], None]) -> None:
        """vLLM's `unpin_blocks`: drop one reference of each (those left unreferenced join the
        queue's tail) and call `on_reuse(block)` once when the block is next handed out."""
        released: list[Block] = []
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} is not referenced")
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    def _notify_reuse(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            watcher = self._reuse_watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)

    def cache(self, block: Block, block_hash: int) -> None:
        """`block` now holds the full block of tokens named by `block_hash`."""
        if block.block_hash is None:
            block.block_hash = block_hash
            self.cached.setdefault(block_hash, {})[block.block_id] = block

    def free_blocks(self, ordered_blocks: Iterable[Block]) -> None:
        """Drop one reference of each; those left unreferenced join the free queue: cached ones
        at the tail in this order (first evicted first), uncached ones at the head."""
        first: list[Block] = []
        last: list[Block] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.block_hash is None else last).append(block)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def reset(self) -> None:
        """vLLM's `reset_prefix_cache` (every block free): every watched block's callback,
        then every hash forgotten."""
        self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            if block.block_hash is not None:
                self._evict(block)
                self.evictions -= 1  # a reset is not an eviction

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        holders = self.cached[block.block_hash]
        del holders[block.block_id]
        if not holders:
            del self.cached[block.block_hash]
        block.block_hash = None
        self.evictions += 1


@dataclass(frozen=True, slots=True)
class TokenIds:
    """A run of known token ids: its blocks are named by the ids themselves, so two runs
    that share leading ids share those blocks (the prompt's fixed text before a question)."""

    ids: tuple[int, ...]


Segment = tuple[Hashable, int]
"""(content, tokens): a run of tokens named by what they are (a document key, the root, ...),
or a `TokenIds` and its length."""


class BlockHasher:
    """Names full blocks of token runs as vLLM's hashes do: block i's name depends on its own
    tokens and on every token before it. Names are small ints, interned exactly (no
    collisions: two blocks share a name only when their whole prefixes are the same tokens)."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self._names: dict[tuple[int, tuple[tuple[Hashable, int, int], ...]], int] = {}

    def hashes(self, segments: Sequence[Segment]) -> list[int]:
        """The names of the full blocks of `segments` laid end to end (a partial last block
        has none)."""
        size = self.block_size
        names: list[int] = []
        parent = -1
        piece: list[tuple[Hashable, int, int]] = []
        filled = 0
        for content, length in segments:
            offset = 0
            while offset < length:
                take = min(size - filled, length - offset)
                if isinstance(content, TokenIds):
                    piece.append((content.ids[offset : offset + take], 0, take))
                else:
                    piece.append((content, offset, offset + take))
                offset += take
                filled += take
                if filled == size:
                    key = (parent, tuple(piece))
                    parent = self._names.setdefault(key, len(self._names))
                    names.append(parent)
                    piece, filled = [], 0
        return names
