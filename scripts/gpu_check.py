"""One step of the GPU check (run by `scripts/gpu_check.sh`, one process per step).

    python scripts/gpu_check.py STEP --out DIR      STEP: device | layout | kernels | pinned
    python scripts/gpu_check.py summary --out DIR   merge DIR/*.json, print, exit 0/1/2

Runs where vLLM cannot be installed (the H200 machine: torch + CUDA, Triton, no vLLM): it
imports only `ragcache_core.storage.*` and `ragcache_core.errors`, and builds the caches the
way vLLM lays them out (`kv_layout.vllm_style_views`, through `gpu_check_tools.py`, which the
steps share). Each step writes DIR/STEP.json:

    {"step", "ok", "skipped" (a reason, or null), "checks": [{"name", "ok", "detail"}],
     "figures": {name: number}, "errors": [traceback text]}

A check or figure that raises is recorded and the step goes on. Bandwidths are bytes copied
per second (each byte is read once and written once); "traffic" figures count both, which is
what the HBM figure measures. Times are CUDA-event medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from gpu_check_tools import (
    HBM_GBPS,
    ORDERS,
    PCIE_GBPS,
    STEPS,
    Run,
    Step,
    build_cache,
    cache_bits,
    clone_cache,
    copy_ceiling,
    cuda_or_none,
    random_bits,
    same_bits,
)


def step_device(step: Step, run: Run) -> None:
    import torch
    import triton

    step.record["versions"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
    }
    if run.dry:
        step.record["dry_run"] = True
        step.check("dry run on CPU (Triton interpreter)", True, "figures are meaningless")
        return
    why = cuda_or_none()
    if why:
        step.record["skipped"] = why
        step.check("CUDA device", False, why)
        return
    props = torch.cuda.get_device_properties(0)
    step.record["device"] = {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "count": torch.cuda.device_count(),
    }
    step.check("CUDA device", True, props.name)
    x = torch.arange(1 << 20, device="cuda")
    step.check("a CUDA kernel runs", int(x.sum()) == (1 << 20) * ((1 << 20) - 1) // 2)


def step_layout(step: Step, run: Run) -> None:
    """Torch and Triton load/store round trips on vLLM-style CUDA views, bit-exact: every
    layout vLLM registers (LBNHC default, LBHNC, BLNHC), kernel blocks, bf16 and fp32."""
    import torch
    from copy_reference import reference_gather_tokens, reference_scatter_tokens

    from ragcache_core.storage.copy.torch_ops import TorchCopyOps
    from ragcache_core.storage.copy.triton_ops import TritonCopyOps

    device, model = run.device, run.small()
    tokens, blocks = (64, 16) if run.dry else (256, 64)
    index = run.index(tokens=tokens, span=tokens // 4, blocks=blocks, seed=1)
    pool_shape = (tokens // 16, model["layers"], 2, 16, model["heads"], model["head_size"])
    cases = [
        (order, ratio, dtype)
        for order in ORDERS
        for ratio in (1, 2)
        for dtype in (torch.bfloat16, torch.float32)
        if not (ratio == 2 and ORDERS[order][0] != 0)  # kernel blocks: layer-outermost only
    ]
    for order, ratio, dtype in cases:
        name = f"{order} ratio {ratio} {str(dtype).split('.')[-1]}"

        def case(
            order: str = order, ratio: int = ratio, dtype: Any = dtype, name: str = name
        ) -> None:
            pool = random_bits(pool_shape, dtype, device)  # [S, L, 2, 16, H, D]
            base = build_cache(order, ratio, dtype, blocks, model, device)
            results = {}
            for label, ops in (("torch", TorchCopyOps(device)), ("triton", TritonCopyOps(device))):
                paged = clone_cache(base, order, ratio, dtype, blocks, model, device)
                ops.load(pool, index, paged)
                back = torch.zeros_like(pool)
                ops.store(paged, index, back)
                ops.synchronize()
                results[label] = (cache_bits(paged), back)
            ref = clone_cache(base, order, ratio, dtype, blocks, model, device)
            reference_scatter_tokens(pool, ref.flats, ref.strided, index)
            ref_back = torch.zeros_like(pool)
            reference_gather_tokens(ref.flats, ref.strided, index, ref_back)
            (triton_cache, triton_back), (torch_cache, torch_back) = (
                results["triton"],
                results["torch"],
            )
            layout = base.strided
            step.check(
                f"{name}: Triton load == torch load (whole cache)",
                same_bits(triton_cache, torch_cache),
                f"block {layout.block_size}, strides block {layout.block_stride} head "
                f"{layout.head_stride} token {layout.token_stride} layer {layout.layer_stride}",
            )
            step.check(f"{name}: torch load == reference", same_bits(torch_cache, cache_bits(ref)))
            step.check(
                f"{name}: Triton store == torch store == reference",
                same_bits(triton_back, torch_back) and same_bits(torch_back, ref_back),
            )
            step.check(f"{name}: store(load(pool)) == pool", same_bits(triton_back, pool))

        step.guard(name, case)


def step_kernels(step: Step, run: Run) -> None:
    """Triton kernels on a Llama-3-8B-sized step: bit-exact, and GB/s against torch copy_."""
    import torch
    from copy_reference import reference_gather_tokens, reference_scatter_tokens

    from ragcache_core.storage.copy.torch_ops import TorchCopyOps
    from ragcache_core.storage.copy.triton_kernels import copy_slots, gather_tokens, scatter_tokens

    device, model, dtype = run.device, run.model, torch.bfloat16
    index = run.index(tokens=run.tokens, span=run.span, blocks=run.blocks, seed=2)
    slots = run.tokens // 16
    pool_shape = (slots, model["layers"], 2, 16, model["heads"], model["head_size"])
    pool = random_bits(pool_shape, dtype, device)  # [256, 32, 2, 16, 8, 128]
    nbytes = pool.numel() * pool.element_size()  # one step's K and V, every layer
    step.figure(f"step MiB ({run.tokens} tokens x {model['layers']} layers)", nbytes / 2**20)
    ceiling = copy_ceiling(run, nbytes)
    step.figure("torch copy_ ceiling GB/s (copied)", ceiling)
    step.figure(f"torch copy_ ceiling traffic GB/s (HBM: {HBM_GBPS:.0f})", 2 * ceiling)
    step.record["hardware"] = {"hbm_gbps": HBM_GBPS}
    step.figure("H200 HBM3e GB/s (read + write traffic, spec)", HBM_GBPS)

    for order in ("LBNHC", "BLNHC"):

        def tokens(order: str = order) -> None:
            paged = build_cache(order, 1, dtype, run.blocks, model, device)
            layout = paged.strided
            ref = clone_cache(paged, order, 1, dtype, run.blocks, model, device)
            scatter_tokens(pool, paged.flats, layout, index)
            reference_scatter_tokens(pool, ref.flats, layout, index)
            same = same_bits(cache_bits(paged), cache_bits(ref))
            step.check(f"{order}: scatter_tokens == reference", same)
            back, ref_back = torch.zeros_like(pool), torch.zeros_like(pool)
            gather_tokens(paged.flats, layout, index, back)
            reference_gather_tokens(paged.flats, layout, index, ref_back)
            step.check(f"{order}: gather_tokens == reference", same_bits(back, ref_back))
            step.check(f"{order}: gather(scatter(pool)) == pool", same_bits(back, pool))
            load = nbytes / run.seconds(lambda: scatter_tokens(pool, paged.flats, layout, index))
            store = nbytes / run.seconds(lambda: gather_tokens(paged.flats, layout, index, back))
            step.figure(f"{order} scatter_tokens (load) GB/s", load / 1e9)
            step.figure(f"{order} gather_tokens (store) GB/s", store / 1e9)
            step.figure(f"{order} load % of copy_ ceiling", 100 * load / 1e9 / ceiling)
            step.figure(f"{order} store % of copy_ ceiling", 100 * store / 1e9 / ceiling)
            ops = TorchCopyOps(device)
            t_load = run.seconds(lambda: ops.load(pool, index, paged), iters=5)
            t_store = run.seconds(lambda: ops.store(paged, index, back), iters=5)
            step.figure(f"{order} TorchCopyOps.load GB/s", nbytes / t_load / 1e9)
            step.figure(f"{order} TorchCopyOps.store GB/s", nbytes / t_store / 1e9)

        step.guard(f"{order} token kernels", tokens)

    def pool_to_pool() -> None:
        perm = torch.randperm(slots, generator=torch.Generator().manual_seed(3))
        src_slots, dst_slots = perm.to(device), torch.arange(slots, device=device)
        dst = torch.zeros_like(pool)
        copy_slots(pool, src_slots, dst, dst_slots)
        step.check("copy_slots (permuted) == pool[perm]", same_bits(dst, pool[src_slots]))
        t = run.seconds(lambda: copy_slots(pool, src_slots, dst, dst_slots))
        step.figure(
            f"copy_slots GPU->GPU GB/s ({slots} permuted slots, 1 launch)", nbytes / t / 1e9
        )
        perm_list, dst_list = perm.tolist(), list(range(slots))
        torch_copy = TorchCopyOps(device).copy_pages  # one copy_ per run of slots
        t = run.seconds(lambda: torch_copy(pool, perm_list, dst, dst_list), iters=5)
        step.figure(f"torch copy_ GPU->GPU GB/s ({slots} runs)", nbytes / t / 1e9)

    step.guard("copy_slots GPU->GPU", pool_to_pool)


def step_pinned(step: Step, run: Run) -> None:
    """A HostPool in /dev/shm, registered; host<->GPU copy_slots over UVA and the torch
    fallback, bit-exact, GB/s against torch's pinned copy_; host-pool loads; unregister."""
    import torch

    from ragcache_core.storage.copy.torch_ops import TorchCopyOps
    from ragcache_core.storage.copy.triton_kernels import copy_slots
    from ragcache_core.storage.copy.triton_ops import TritonCopyOps
    from ragcache_core.storage.host_pool import HostPool, shm_folder
    from ragcache_core.storage.memory import free_bytes_at
    from ragcache_core.storage.pool_layout import PoolLayout

    device, model, cuda = run.device, run.model, run.device.type == "cuda"
    layout = PoolLayout(
        num_layers=model["layers"],
        num_kv_heads=model["heads"],
        head_size=model["head_size"],
        dtype="bfloat16",
        page_size=16,
    )
    # A step's slots (256: 512 MiB) unless the tmpfs is smaller (a container's /dev/shm may
    # be 64 MiB): then fewer, and the figures say how many.
    room = int(0.8 * free_bytes_at(shm_folder()))
    slots = max(2, min(run.tokens // 16, room // layout.slot_bytes))
    nbytes = slots * layout.slot_bytes
    tokens = slots * layout.page_size
    step.figure("host pool MiB", nbytes / 2**20)
    step.record["hardware"] = {"pcie_gbps_per_direction": PCIE_GBPS}
    step.figure("PCIe Gen5 x16 GB/s per direction (theoretical, H200 SXM)", PCIE_GBPS)
    host = HostPool.create(f"gpu-check-{uuid.uuid4().hex[:8]}", layout, slots)
    ops = TritonCopyOps(device)
    try:
        host.tensor.copy_(random_bits(tuple(host.tensor.shape), torch.bfloat16, device).cpu())
        ops.register_host(host.tensor)
        if cuda:  # whether torch sees it as pinned (its copy_ is then a direct DMA)
            step.figure("torch is_pinned() after register (1 = yes)", host.tensor.is_pinned())
        dev = torch.zeros(tuple(host.tensor.shape), dtype=torch.bfloat16, device=device)
        perm = torch.randperm(slots, generator=torch.Generator().manual_seed(4))
        ident = torch.arange(slots)

        def ceilings() -> None:
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
            on_gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
            t = run.seconds(lambda: on_gpu.copy_(pinned, non_blocking=True), iters=5)
            step.figure("torch pinned copy_ H2D GB/s (ceiling)", nbytes / t / 1e9)
            t = run.seconds(lambda: pinned.copy_(on_gpu, non_blocking=True), iters=5)
            step.figure("torch pinned copy_ D2H GB/s (ceiling)", nbytes / t / 1e9)

        step.guard("pinned copy_ ceilings", ceilings)

        def fallback() -> None:
            perm_list, ident_list = perm.tolist(), ident.tolist()
            torch_copy = TorchCopyOps(device).copy_pages  # TritonCopyOps' fallback
            torch_copy(host.tensor, perm_list, dev, ident_list)
            run.sync()
            same = same_bits(dev.cpu(), host.tensor[perm])
            step.check("torch fallback H2D (permuted) bit-exact", same)
            for label, order in (("1 run", ident_list), (f"{slots} runs", perm_list)):
                t = run.seconds(
                    lambda o=order: torch_copy(host.tensor, o, dev, ident_list), iters=5
                )
                step.figure(f"torch fallback H2D GB/s ({label})", nbytes / t / 1e9)
                t = run.seconds(
                    lambda o=order: torch_copy(dev, ident_list, host.tensor, o), iters=5
                )
                step.figure(f"torch fallback D2H GB/s ({label})", nbytes / t / 1e9)

        step.guard("torch fallback copies", fallback)

        # The UVA kernels last: a fault there is sticky and would void what follows.
        def uva() -> None:
            src, dst = perm.to(device), ident.to(device)
            copy_slots(host.tensor, src, dev, dst)
            run.sync()
            same = same_bits(dev.cpu(), host.tensor[perm])
            step.check("UVA copy_slots H2D (permuted) bit-exact", same)
            t = run.seconds(lambda: copy_slots(host.tensor, src, dev, dst), iters=5)
            step.figure("UVA copy_slots H2D GB/s", nbytes / t / 1e9)
            fresh = random_bits(tuple(dev.shape), torch.bfloat16, device)
            copy_slots(fresh, dst, host.tensor, src)
            run.sync()
            same = same_bits(host.tensor[perm], fresh.cpu())
            step.check("UVA copy_slots D2H (permuted) bit-exact", same)
            t = run.seconds(lambda: copy_slots(fresh, dst, host.tensor, src), iters=5)
            step.figure("UVA copy_slots D2H GB/s", nbytes / t / 1e9)

        step.guard("UVA copy_slots (Triton on registered host memory)", uva)

        def copy_pages_paths() -> None:
            """TritonCopyOps picks UVA for registered memory; uva=False falls back to torch."""
            a, b = torch.zeros_like(dev), torch.zeros_like(dev)
            ops.copy_pages(host.tensor, perm.tolist(), a, ident.tolist())
            no_uva = TritonCopyOps(device, uva=False)
            no_uva.copy_pages(host.tensor, perm.tolist(), b, ident.tolist())
            run.sync()
            step.check("copy_pages: UVA path == torch path", same_bits(a, b))
            if cuda:
                step.check(
                    "TritonCopyOps.addressable(registered pool)", ops.addressable(host.tensor)
                )

        step.guard("copy_pages paths", copy_pages_paths)

        def host_loads() -> None:
            """A step's load straight from the host pool: UVA rows vs staged slots."""
            index = run.index(tokens=tokens, span=min(run.span, tokens), blocks=run.blocks, seed=5)
            direct = build_cache("LBNHC", 1, torch.bfloat16, run.blocks, model, device)
            staged = clone_cache(direct, "LBNHC", 1, torch.bfloat16, run.blocks, model, device)
            no_uva = TritonCopyOps(device, uva=False)
            ops.load(host.tensor, index, direct)
            no_uva.load(host.tensor, index, staged)
            run.sync()
            same = same_bits(cache_bits(direct), cache_bits(staged))
            step.check("host-pool load: UVA rows == staged slots", same)
            t = run.seconds(lambda: ops.load(host.tensor, index, direct), iters=5)
            step.figure("host-pool load via UVA GB/s", nbytes / t / 1e9)
            t = run.seconds(lambda: no_uva.load(host.tensor, index, staged), iters=5)
            step.figure("host-pool load staged (torch H2D + kernel) GB/s", nbytes / t / 1e9)

        step.guard("host-pool loads", host_loads)
    finally:

        def unregister() -> None:
            ops.unregister_host(host.tensor)
            if cuda:
                pinned = host.tensor.is_pinned()
                step.figure("torch is_pinned() after unregister (0 = no)", pinned)

        step.guard("cudaHostUnregister", unregister)
        host.unlink()  # also after a CUDA error: the file must not outlive the check
        step.check("pool file removed", not host.path.exists(), str(host.path))


# ------------------------------------------------------------------------------------------


def summary(out: Path) -> int:
    """Merge the steps' JSON (and the shell's exit codes) into gpu_check.json; print it.
    Returns 0 when every check passed, 2 when there is no CUDA device, 1 otherwise."""
    merged: dict[str, Any] = {"steps": {}, "ok": True}
    for name in STEPS:
        path, rc_path = out / f"{name}.json", out / f"{name}.rc"
        rc = int(rc_path.read_text().strip()) if rc_path.exists() else None
        if path.exists():
            record = json.loads(path.read_text())
        else:
            why = "timed out" if rc in (124, 137) else f"exited {rc} without a result"
            record = {"step": name, "ok": False, "skipped": None, "checks": [], "figures": {}}
            record["errors"] = [why if rc is not None else "did not run"]
        record["rc"] = rc
        merged["steps"][name] = record
    device = merged["steps"]["device"]
    no_cuda = device.get("skipped") if device.get("rc") is not None else None
    merged["no_cuda"] = no_cuda
    merged["ok"] = all(r["ok"] for r in merged["steps"].values()) and not no_cuda
    (out / "gpu_check.json").write_text(json.dumps(merged, indent=1))
    print("== GPU check summary")
    if no_cuda:
        print(f"  NO CUDA DEVICE: {no_cuda}; nothing was checked")
        return 2
    if device.get("dry_run"):
        print("  DRY RUN on CPU (Triton interpreter, tiny shapes): the figures mean nothing")
    for name, record in merged["steps"].items():
        failed = [c["name"] for c in record["checks"] if not c["ok"]]
        status = "ok" if record["ok"] else "FAIL"
        print(f"  {name:8s} {status}  {len(record['checks'])} checks, {len(failed)} failed")
        for f in failed:
            print(f"      failed: {f}")
        for e in record.get("errors", []):
            print(f"      error: {e.strip().splitlines()[-1] if e.strip() else e}")
        for key, value in record["figures"].items():
            print(f"      {key}: {value}")
    print(f"  results: {out / 'gpu_check.json'}")
    return 0 if merged["ok"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=(*STEPS, "summary"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, Triton interpreter, tiny shapes: checks this script, not the GPU",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step == "summary":
        return summary(args.out)
    if args.dry_run:  # read when the kernels are decorated: before triton_copy is imported
        os.environ["TRITON_INTERPRET"] = "1"
    step = Step(args.step)
    started = time.monotonic()
    print(f"== {args.step}{' (dry run)' if args.dry_run else ''}", flush=True)
    try:
        why = None if args.step == "device" or args.dry_run else cuda_or_none()
        if why:
            step.record["skipped"] = why
            step.check("CUDA device", False, why)
        else:
            steps = {
                "device": step_device,
                "layout": step_layout,
                "kernels": step_kernels,
                "pinned": step_pinned,
            }
            steps[args.step](step, Run.make(args.dry_run))
    except Exception as exc:
        step.record["errors"].append(traceback.format_exc())
        step.check(f"{args.step} step", False, f"raised {type(exc).__name__}: {exc}")
    step.record["seconds"] = round(time.monotonic() - started, 1)
    step.write(args.out)
    return 0 if step.record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
