"""The tools the GPU check's steps share (`scripts/gpu_check.py`): where and how big a run is
(`Run`), a step's record (`Step`), random caches laid out as vLLM lays them out, and the
bit-exact comparisons. Imports only `ragcache_core.storage.*` (torch, Triton; no vLLM).
"""

from __future__ import annotations

import json
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS = ("device", "layout", "kernels", "pinned")
HBM_GBPS = 4800.0  # H200 HBM3e, read + write traffic
PCIE_GBPS = 64.0  # PCIe Gen5 x16, per direction, theoretical
LBNHC, LBHNC, BLNHC = (0, 1, 3, 2, 4), (0, 1, 2, 3, 4), (1, 0, 3, 2, 4)
ORDERS = {"LBNHC": LBNHC, "LBHNC": LBHNC, "BLNHC": BLNHC}


@dataclass(frozen=True)
class Run:
    """Where and how big: the real run (CUDA, Llama-3-8B's KV: 32 layers, 8 KV heads of 128,
    bf16, blocks of 16; a step of 4,096 tokens in spans of 512) or `--dry-run` (CPU under
    `TRITON_INTERPRET=1`, tiny shapes: checks this script, measures nothing meaningful)."""

    device: Any
    dry: bool
    model: dict[str, int]  # layers, heads, head_size, block_size
    tokens: int  # one step
    span: int
    blocks: int  # cache blocks per layer

    @classmethod
    def make(cls, dry: bool) -> Run:
        import torch

        if dry:
            model = {"layers": 2, "heads": 2, "head_size": 16, "block_size": 16}
            return cls(torch.device("cpu"), True, model, tokens=64, span=32, blocks=16)
        model = {"layers": 32, "heads": 8, "head_size": 128, "block_size": 16}
        return cls(torch.device("cuda"), False, model, tokens=4096, span=512, blocks=2048)

    def small(self) -> dict[str, int]:
        """The layout step's model: few layers, real heads (fewer when dry)."""
        return {**self.model, "layers": 2 if self.dry else 4}

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def seconds(self, fn: Callable[[], None], iters: int = 10, warmup: int = 2) -> float:
        """Median time of `fn`: CUDA events around each call (wall clock when dry)."""
        import torch

        if self.dry:
            iters, warmup = 1, 0
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(iters):
            if self.dry:
                start_s = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start_s)
                continue
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def index(self, *, tokens: int, span: int, blocks: int, seed: int) -> Any:
        """`spans_index` on this run's device (pool pages of 16 tokens)."""
        from ragcache_core.storage.copy.base import TokenIndex

        cpu = spans_index(
            tokens=tokens,
            span=span,
            page=16,
            num_blocks=blocks,
            block_size=self.model["block_size"],
            seed=seed,
        )
        return TokenIndex(
            cpu.pool_slots.to(self.device),
            cpu.pool_rows.to(self.device),
            cpu.slot_mapping.to(self.device),
        )


class Step:
    """The record of one step: checks, figures and errors, written as JSON."""

    def __init__(self, name: str) -> None:
        self.record: dict[str, Any] = {
            "step": name,
            "ok": True,
            "skipped": None,
            "checks": [],
            "figures": {},
            "errors": [],
        }

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.record["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.record["ok"] &= bool(ok)
        print(f"  [{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)

    def figure(self, name: str, value: float) -> None:
        self.record["figures"][name] = round(float(value), 3)
        print(f"  {name} = {value:.3f}", flush=True)

    def guard(self, what: str, fn: Callable[[], None]) -> None:
        """Run `fn`; an exception becomes a failed check (with its traceback), not an exit."""
        try:
            fn()
        except Exception as exc:
            self.record["errors"].append(f"{what}: {traceback.format_exc()}")
            self.check(what, False, f"raised {type(exc).__name__}: {exc}")

    def write(self, out: Path) -> None:
        (out / f"{self.record['step']}.json").write_text(json.dumps(self.record, indent=1))


def cuda_or_none() -> str | None:
    """None when a CUDA device is usable, else why not."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    return None


def same_bits(a: Any, b: Any) -> bool:
    import torch

    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and bool(
        torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    )


def random_bits(shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
    """Random contents of `dtype` made of random bits (every pattern, NaNs included: the
    copies must move bits, not values)."""
    import torch

    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    bits = width[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, shape, dtype=bits, device=device)
    return raw.view(dtype)


def spans_index(
    *, tokens: int, span: int, page: int, num_blocks: int, block_size: int, seed: int
) -> Any:
    """A TokenIndex of `tokens` tokens in spans of `span`: span j reads pool slots
    [j * span / page, ...) in order and lands at a random block with a random offset inside
    it (spans cross blocks), spans in disjoint cache regions."""
    import torch

    from ragcache_core.storage.copy.base import TokenIndex

    gen = torch.Generator().manual_seed(seed)
    count = tokens // span
    region = num_blocks * block_size // count  # each span's share of the cache
    if region < span + block_size:
        raise ValueError("cache too small for the spans")
    slots, rows, mapping = [], [], []
    for j in range(count):
        start = j * region + int(torch.randint(0, region - span, (1,), generator=gen))
        t = torch.arange(span)
        slots.append(j * (span // page) + t // page)
        rows.append(t % page)
        mapping.append(start + t)
    return TokenIndex(torch.cat(slots), torch.cat(rows), torch.cat(mapping))


def build_cache(
    order: str, ratio: int, dtype: Any, num_blocks: int, shape: dict[str, int], device: Any
) -> Any:
    """vLLM-style per-layer views over one random CUDA buffer, as a `LinearPagedKV`."""
    from ragcache_core.storage.paged_layout import strided_paged_kv, vllm_style_views

    numel = shape["layers"] * num_blocks * shape["block_size"] * shape["heads"] * 2
    numel *= shape["head_size"]
    views = vllm_style_views(
        random_bits((numel,), dtype, device),
        order=ORDERS[order],
        num_layers=shape["layers"],
        num_blocks=num_blocks,
        num_heads=shape["heads"],
        block_size=shape["block_size"],
        head_size=shape["head_size"],
        ratio=ratio,
    )
    return strided_paged_kv(
        views,
        block_size=shape["block_size"],
        num_kv_heads=shape["heads"],
        head_size=shape["head_size"],
        backend=f"gpu-check {order}",
    )


def cache_bits(paged: Any) -> Any:
    """Every element from layer 0's first to the last layer's last: the whole buffer the views
    share (one allocation, layers in order), so a stray write anywhere shows. Not a cat of the
    layer windows: with layers interleaved (BLNHC) each window spans nearly the whole buffer."""
    import torch

    first, last = paged.flats[0], paged.flats[-1]
    size = (last.data_ptr() - first.data_ptr()) // first.element_size() + last.numel()
    return torch.as_strided(first, (size,), (1,))


def clone_cache(
    base: Any, order: str, ratio: int, dtype: Any, blocks: int, model: dict[str, int], device: Any
) -> Any:
    """A fresh cache of the same layout with `base`'s contents."""
    paged = build_cache(order, ratio, dtype, blocks, model, device)
    for f, g in zip(paged.flats, base.flats, strict=True):
        f.copy_(g)
    return paged


def copy_ceiling(run: Run, nbytes: int) -> float:
    """GB/s of torch `copy_` between two contiguous device tensors of `nbytes`."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    return nbytes / run.seconds(lambda: dst.copy_(src)) / 1e9
