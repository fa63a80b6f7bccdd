"""The systems `bench serve` and `demo` measure, by name (docs/benchmarks.md, "Systems").

| system            | what                                                                    |
|-------------------|-------------------------------------------------------------------------|
| `vllm`            | vLLM + the same search, prefix caching off (the paper's baseline)        |
| `vllm-apc`        | prefix caching on, KV = RAGCache's vLLM KV (its GPU tier: same "GPU")    |
| `vllm-apc-total`  | prefix caching on, KV = RAGCache's vLLM KV + host pool (same total KV)   |
| `ragcache`        | RAGCache (knowledge tree, DGDSF, reordering, speculative pipelining)    |
| `vllm-offload`    | prefix caching + vLLM's OffloadingConnector, the host pool's size (CUDA) |
| `vllm-offload-lazy` | prefix caching + SimpleCPUOffloadConnector, lazy_offload (CUDA)       |
| `ragcache-onekv`  | RAGCache with its host pool's memory in vLLM's KV instead (no host tier) |
| `ragcache-writethrough` | RAGCache with its host tier written as computed (explicitly)     |
| `ragcache-lookahead` | RAGCache, a look-ahead of one step beside its copies at hand-out    |
| `ragcache-offload-proxy` | RAGCache's plumbing as vLLM's OffloadingConnector: write-through, |
|                   | LRU, FCFS, no speculation                                               |
| `ragcache-offload-proxy-arc` | the same with ARC (its `eviction_policy="arc"`)              |
| `ragcache-offload-proxy-lazy` | as SimpleCPUOffloadConnector lazy_offload: eviction-time     |
|                   | writes, LRU, copied blocks back at the free queue's tail, FCFS          |
| `ragcache-docorder` | RAGCache, `document_order="cache"` (its prompts differ: not compared) |
| `ragcache-nohost` / `-lru` / `-lfu` / `-noreorder` / `-nospec`: ablations (host pool 0, ...) |
| `ragcache-twin`: a second identical RAGCache engine (the A/A check of a run's spread)     |
| `ragcache-onefill` (`-fcfs`), `ragcache-twofill`: one (two) requests in prefill at most      |
| `vllm-noconn` / `vllm-apc-noconn`: the baselines without the idle connector they load       |

The proxies are RAGCache with the same memory layout as `ragcache`, each standing for one of
vLLM's own CPU offloading options, which run on CUDA only; each names the vLLM file and
behaviour it models in docs/benchmarks.md. They set every switch they depend on explicitly
(`host_write` above all), so a change of RAGCache's defaults does not change what they model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

SystemKind = Literal["vllm", "ragcache"]


@dataclass(frozen=True)
class SystemSpec:
    """A named system: which engine, and (RAGCache) which `CacheConfig` changes."""

    name: str
    kind: SystemKind
    what: str
    changes: Mapping[str, Any] = field(default_factory=dict)
    parent: str | None = None
    """An ablation's system: what it takes one thing away from (measured beside it)."""
    host_kv_to_vllm: bool = False
    """RAGCache with no host tier, its memory given to vLLM's KV cache (the GPU tier)
    instead: the same total KV as `ragcache` and `vllm-apc-total`, in one memory."""
    cuda_only: str | None = None
    """Why the system runs only where a CUDA vLLM runs (None: it runs anywhere); the one line
    a run off CUDA is refused with."""

    @property
    def ablation(self) -> bool:
        return self.parent is not None

    @property
    def caches(self) -> bool:
        """Whether the system keeps any KV between requests (plain vLLM, prefix caching off,
        does not: a warm-up leaves it as it was)."""
        return self.kind == "ragcache" or self.name.startswith(("vllm-apc", "vllm-offload"))


FCFS_NO_SPECULATION = {"reorder": False, "speculation": False}
"""What every proxy of vLLM's offloading has: vLLM serves first come first served and starts
a prompt only once its documents are known."""
LOOKAHEAD_TOKENS = 4096
"""The look-ahead of the systems that have one: one step's token budget on CPU
(`max_num_batched_tokens`), what vLLM's lazy offload watches at least."""

SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec("vllm", "vllm", "vLLM, prefix caching off, RAGCache connector loaded idle"),
        SystemSpec("vllm-apc", "vllm", "vLLM prefix caching, KV = RAGCache's vLLM KV"),
        SystemSpec(
            "vllm-apc-total", "vllm", "vLLM prefix caching, KV = RAGCache's vLLM KV + host pool"
        ),
        SystemSpec(
            "vllm-offload",
            "vllm",
            "vLLM prefix caching + its OffloadingConnector of the host pool's size (CUDA only)",
            cuda_only=(
                "vllm-offload needs a CUDA vLLM: vLLM refuses its native CPU offload here "
                '("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs", '
                "vllm/v1/kv_offload/cpu/spec.py)"
            ),
        ),
        SystemSpec(
            "vllm-offload-lazy",
            "vllm",
            "vLLM prefix caching + SimpleCPUOffloadConnector, lazy_offload, of the host pool's "
            "size (CUDA only)",
            cuda_only=(
                "vllm-offload-lazy needs a CUDA vLLM: SimpleCPUOffloadConnector copies with CUDA "
                "streams and kernels (vllm/v1/simple_kv_offload/copy_backend.py, "
                "cuda_mem_ops.py), which this vLLM build cannot run"
            ),
        ),
        SystemSpec("ragcache", "ragcache", "RAGCache, all mechanisms on"),
        SystemSpec(
            "ragcache-onekv",
            "ragcache",
            "RAGCache, all of its KV in vLLM's cache (no host tier): vllm-apc-total's memory",
            {"host_pool_tokens": 0},
            host_kv_to_vllm=True,
        ),
        SystemSpec(
            "ragcache-writethrough",
            "ragcache",
            "RAGCache, host tier written through (as documents are computed), not at eviction",
            {"host_write": "compute"},
        ),
        SystemSpec(
            "ragcache-lookahead",
            "ragcache",
            "RAGCache, a look-ahead of one step's budget (copies before vLLM hands blocks out, "
            "blocks back at the queue's head) beside its copies at hand-out",
            {"host_write": "eviction", "host_write_window_tokens": LOOKAHEAD_TOKENS},
        ),
        SystemSpec(
            "ragcache-emptylease",
            "ragcache",
            "RAGCache, host lease of empty room (evicted as it is topped up), not of victims",
            {"host_lease_victims": False},
        ),
        SystemSpec(
            "ragcache-docorder",
            "ragcache",
            "RAGCache, documents in the order the cache holds them (document_order=cache)",
            {"document_order": "cache"},
        ),
        SystemSpec(
            "ragcache-offload-proxy",
            "ragcache",
            "RAGCache as vLLM's OffloadingConnector: write-through, LRU, FCFS, no speculation",
            {"policy": "lru", "host_write": "compute", **FCFS_NO_SPECULATION},
        ),
        SystemSpec(
            "ragcache-offload-proxy-arc",
            "ragcache",
            "RAGCache as vLLM's OffloadingConnector with eviction_policy=arc: write-through, "
            "ARC, FCFS, no speculation",
            {"policy": "arc", "host_write": "compute", **FCFS_NO_SPECULATION},
        ),
        SystemSpec(
            "ragcache-offload-proxy-lazy",
            "ragcache",
            "RAGCache as vLLM's SimpleCPUOffloadConnector with lazy_offload: eviction-time "
            "writes of what a look-ahead of one step's budget sees (no copy at hand-out), LRU, "
            "copied blocks back at the queue's tail, FCFS, no speculation",
            {
                "policy": "lru",
                "host_write": "eviction",
                "host_write_at_handout": False,
                "host_write_window_tokens": LOOKAHEAD_TOKENS,
                "host_write_return": "tail",
                **FCFS_NO_SPECULATION,
            },
        ),
        SystemSpec(
            "ragcache-nohost",
            "ragcache",
            "RAGCache, host tier off",
            {"host_pool_tokens": 0},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-lru",
            "ragcache",
            "RAGCache, LRU instead of DGDSF",
            {"policy": "lru"},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-lfu",
            "ragcache",
            "RAGCache, LFU instead of DGDSF",
            {"policy": "lfu"},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-pgdsf",
            "ragcache",
            "RAGCache, PGDSF (the paper's policy) instead of DGDSF",
            {"policy": "pgdsf"},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-budget2",
            "ragcache",
            "RAGCache, prefill admission budget twice vLLM's step (8,192 tokens on CPU)",
            {"prefill_token_budget": 8192},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-onefill",
            "ragcache",
            "RAGCache, one request in prefill at a time (`max_prefill_bs=1`): prefills run one "
            "after another, in the queue's order, instead of packed into one vLLM step",
            {"max_prefill_bs": 1},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-twofill",
            "ragcache",
            "RAGCache, two requests in prefill at most (`max_prefill_bs=2`): under load one "
            "computes while the next waits inside vLLM, so prefills run in sequence without "
            "a step between them",
            {"max_prefill_bs": 2},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-onefill-fcfs",
            "ragcache",
            "RAGCache, one request in prefill at a time, FCFS queue (`ragcache-onefill` without "
            "its reordering)",
            {"max_prefill_bs": 1, "reorder": False},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-noreorder",
            "ragcache",
            "RAGCache, FCFS queue",
            {"reorder": False},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-nospec",
            "ragcache",
            "RAGCache, no speculation",
            {"speculation": False},
            parent="ragcache",
        ),
        SystemSpec(
            "ragcache-twin",
            "ragcache",
            "RAGCache again, a second identical engine: the A/A check that sizes how far two "
            "engines of one run differ with nothing changed",
            parent="ragcache",
        ),
        SystemSpec("vllm-noconn", "vllm", "vLLM without any KV connector", parent="vllm"),
        SystemSpec(
            "vllm-apc-noconn", "vllm", "vLLM-APC without any KV connector", parent="vllm-apc"
        ),
    )
}
MAIN_SYSTEMS = tuple(n for n, s in SYSTEMS.items() if not s.ablation)
ABLATIONS = tuple(n for n, s in SYSTEMS.items() if s.ablation)
CUDA_ONLY = tuple(n for n, s in SYSTEMS.items() if s.cuda_only)
QUALITY_SYSTEMS = ("vllm", "ragcache", "ragcache-docorder")
"""What `bench quality` compares by default: the reference, the cache, the cache's order."""
