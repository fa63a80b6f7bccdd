"""The simulator against the engine: replay a `bench serve` run's stream through `sim.engine`.

    ragcache simulate --replay bench-serve/serve.json

For each workload of the run, the stream is built again as `bench serve` built it (the same
workload, seed, top-k and retriever, the same index, the same prompts from the run's model:
`bench.workloads`, `runtime.prompt`), warm-up first, in order. Each system of the run that
caches (RAGCache's, and the baselines with vLLM's prefix caching) is then simulated with its
memory and settings, and its hit rates are printed beside the engine's, averaged over the
run's points (every point starts cold and replays the same stream):

  * `token_hit_rate`, cached prompt tokens / prompt tokens, is what `bench serve` records;
  * the document-token hit rate (cached document tokens / document tokens) is the simulator's
    own, and the engine's is derived from its token hit rate: the stream's prompts are known
    exactly, the root (template and system prompt) is cached in every measured request and
    no question token is (questions are not repeated within a stream), so the engine's
    cached document tokens are its cached tokens less the roots'.

Beside them, the stream's ceiling (`reuse_ceiling`): the document-token hit rate with unbounded
memory. A system at the ceiling hits every document the stream repeats; no policy, tier or
amount of memory can add a hit there.

The simulator runs requests one at a time; the engine's warm-up runs 4 at a time and its
measured requests arrive as a Poisson stream, so their steps interleave (docs/control-plane.md,
"The engine's tiers, simulated").
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragcache_core.bench.data_dir import require_data, resolve_data_dir
from ragcache_core.bench.serve import SYSTEMS, resolved
from ragcache_core.bench.workloads import (
    RETRIEVERS,
    WORKLOADS,
    index_source,
    load_workload,
    workload_files,
)
from ragcache_core.config import CacheConfig, refuse_removed_policy
from ragcache_core.errors import InputError
from ragcache_core.policy import POLICIES
from ragcache_core.sim.blocks import TokenIds
from ragcache_core.sim.engine import EngineConfig, EngineRequest, EngineResult, EngineSimulator

GIB = 1 << 30


@dataclass(frozen=True)
class ReplayRow:
    """One system on one workload: the engine's measured hit rates and the simulator's."""

    workload: str
    system: str
    points: int
    engine_token_hit_rate: float
    engine_doc_token_hit_rate: float
    sim: EngineResult
    engine_prompt_tokens_mean: float
    sim_prompt_tokens_mean: float
    config: EngineConfig
    sim_host_tokens_mean: float = 0.0
    """Tokens of the simulated tree's ready host copies, after each measured request, mean."""
    sim_both_tiers_tokens_mean: float = 0.0
    """Of those, tokens of documents vLLM's blocks hold too (promoted by a host hit and not yet
    evicted again, or written through): what dropping a promoted document's host copy could
    add to the two tiers' union at most."""
    ceiling_doc_token_hit_rate: float = 0.0
    """The stream's own bound (`reuse_ceiling`): what any cache of any size could hit."""

    @property
    def gap_points(self) -> float:
        """Simulator less engine, document-token hit rate, in percentage points."""
        return 100 * (self.sim.doc_token_hit_rate - self.engine_doc_token_hit_rate)

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "system": self.system,
            "points": self.points,
            "engine_token_hit_rate": self.engine_token_hit_rate,
            "sim_token_hit_rate": self.sim.token_hit_rate,
            "engine_doc_token_hit_rate": self.engine_doc_token_hit_rate,
            "sim_doc_token_hit_rate": self.sim.doc_token_hit_rate,
            "gap_points": self.gap_points,
            "engine_prompt_tokens_mean": self.engine_prompt_tokens_mean,
            "sim_prompt_tokens_mean": self.sim_prompt_tokens_mean,
            "sim_host_tokens_mean": self.sim_host_tokens_mean,
            "sim_both_tiers_tokens_mean": self.sim_both_tiers_tokens_mean,
            "ceiling_doc_token_hit_rate": self.ceiling_doc_token_hit_rate,
            "sim": self.sim.to_json(),
            "config": {k: getattr(self.config, k) for k in self.config.__dataclass_fields__},
        }


def replay(
    path: Path,
    workloads: tuple[str, ...] | None = None,
    data_dir: Path | None = None,
    policy: str | None = None,
) -> list[ReplayRow]:
    """Every caching system of every (named) workload of the run at `path` (`data_dir`: the
    benchmark data folder, as `load_workload` takes it). `policy`: the simulator's host tier
    under that replacement policy instead of each system's (what the run would have hit; the
    engine's columns stay the run's). Raises `InputError` for a file that is not a `bench
    serve` JSON, a workload it does not hold or an unknown policy."""
    if policy is not None and policy not in POLICIES:
        refuse_removed_policy(policy)
        choices = ", ".join(POLICIES)
        raise InputError(f"unknown replacement policy {policy!r}; choose one of {choices}")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        settings = document["settings"]
        runs = {w["name"]: w for w in document["workloads"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: not a `ragcache bench serve` serve.json ({exc})") from exc
    names = workloads or tuple(n for n in runs if n in WORKLOADS)
    missing = [n for n in names if n not in runs]
    if missing:
        raise InputError(f"{path} holds no workload {missing}; it holds {sorted(runs)}")
    needed = sorted({f for n in names for f in workload_files(n)})
    if needed:  # before the tokenizer loads: a missing data file names the flag
        data_dir = require_data(resolve_data_dir(data_dir), needed)
    rows: list[ReplayRow] = []
    for name in names:
        requests = _stream(settings, runs[name], data_dir)
        sized = runs[name].get("host_sizing")  # a capacity-constrained workload's own host tier
        memory = (
            settings if sized is None else {**settings, "host_pool_tokens": sized["host_tokens"]}
        )
        for system in sorted({p["system"] for p in runs[name]["points"]}):
            config = _engine_config(memory, system)
            if config is not None and policy is not None:
                config = dataclasses.replace(config, policy=policy)
            if config is not None:
                rows.append(_row(name, system, runs[name], settings, requests, config))
    return rows


def _stream(
    settings: dict[str, Any], run: dict[str, Any], data_dir: Path | None
) -> list[EngineRequest]:
    """The run's stream of one workload (warm-up included) as the engine's prompts."""
    from transformers import AutoTokenizer

    from ragcache_core.retrieval.trace import tokenizer_counter
    from ragcache_core.runtime.prompt import PromptBuilder
    from ragcache_core.search import final_result

    model = str(settings["model"])
    retriever = {text: key for key, text in RETRIEVERS.items()}.get(run.get("retriever", ""))
    workload = load_workload(
        run["name"],
        tokenizer_counter(model),
        seed=int(settings["seed"]),
        top_k=run["top_k"],
        data_dir=data_dir,
    )
    workload, source = index_source(workload, retriever or "tfidf", progress=False)
    mode = settings["mode"]
    config = resolved(CacheConfig())
    prompts = PromptBuilder(
        AutoTokenizer.from_pretrained(model), config.prompt, model, str(config.dtype)
    )
    requests: list[EngineRequest] = []
    for request in workload.stream(int(mode["warmup"]) + int(mode["requests"])):
        documents = request.documents
        if documents is None:
            assert source is not None
            documents = final_result(source, request.question, workload.top_k).documents
        built = prompts.build(request.question, documents)
        rest = TokenIds(built.question_ids)  # the template's text after the documents, too
        requests.append(EngineRequest(len(built.root_ids), built.doc_specs, len(rest.ids), rest))
    return requests


def _engine_config(settings: dict[str, Any], system: str) -> EngineConfig | None:
    """The simulated engine of a named system with the run's memory (None: it caches
    nothing, or the simulator does not model it: vLLM's own CPU offload)."""
    spec = SYSTEMS.get(system)
    if spec is None or system in ("vllm", "vllm-noconn", "vllm-offload"):
        return None
    base = CacheConfig(
        host_pool_tokens=int(settings["host_pool_tokens"]),
        vllm_kv_cache_gib=settings["vllm_kv_gib"],
        policy=str(settings.get("policy", "pgdsf")),  # a run that names none predates DGDSF
    )
    token_bytes = int(settings["kv_bytes_per_token"])
    kv_bytes = int(float(settings["vllm_kv_gib"]) * GIB)
    if system.startswith("vllm-apc-total") or spec.host_kv_to_vllm:
        kv_bytes += base.host_pool_tokens * token_bytes
    config = resolved(base.with_(**spec.changes))
    assert config.block_size is not None and config.max_num_batched_tokens is not None
    host_tokens = 0 if spec.kind == "vllm" or spec.host_kv_to_vllm else config.host_pool_tokens
    return EngineConfig(
        vllm_blocks=kv_bytes // (config.block_size * token_bytes),
        host_tokens=host_tokens,
        block_size=config.block_size,
        page_size=config.page_size,
        policy=config.policy,
        store_policy=config.store_policy,
        host_write=config.host_write if host_tokens else "compute",
        host_write_return=config.host_write_return,
        max_num_batched_tokens=config.max_num_batched_tokens,
        window_tokens=config.host_write_window_tokens,
        handout=config.host_write_at_handout,
        max_tokens=int(settings["max_tokens"]),
        max_depth=config.max_cached_depth,
        lease_victims=config.host_lease_victims,
    )


def reuse_ceiling(requests: list[EngineRequest], warmup: int) -> float:
    """The document-token hit rate of the measured requests (those after `warmup`) with
    unbounded memory: a document's tokens count as cached when an earlier request (warm-up
    included) had the same prefix up to and including it (the same root and the same
    documents before it, in order), since its KV is that of its prefix. No cache, of any policy
    or tier, hits more on this stream; at this rate, more memory or a better policy adds
    nothing and a host tier's copies can only cost."""
    seen: set[tuple[object, ...]] = set()
    cached = total = 0
    for index, request in enumerate(requests):
        path: tuple[object, ...] = (request.root_tokens,)
        for doc in request.docs:
            path = (*path, doc.key)
            if index >= warmup:
                total += doc.num_tokens
                cached += doc.num_tokens if path in seen else 0
            seen.add(path)
    return cached / total if total else 0.0


def _row(
    name: str,
    system: str,
    run: dict[str, Any],
    settings: dict[str, Any],
    requests: list[EngineRequest],
    config: EngineConfig,
) -> ReplayRow:
    warmup = int(settings["mode"]["warmup"])
    simulator = EngineSimulator(config)
    served, host, both = [], [], []
    for index, request in enumerate(requests):
        served.append(simulator.serve(request))
        if index >= warmup:
            ready = [n for n in simulator.tree.iter_nodes() if n.ready]
            host.append(sum(n.num_tokens for n in ready))
            both.append(sum(n.num_tokens for n in ready if n.resident))
    sim = simulator.result(served[warmup:])
    measured = requests[warmup:]
    points = [p for p in run["points"] if p["system"] == system]
    engine_rate = statistics.fmean(p["token_hit_rate"] for p in points)
    prompt = sum(
        r.root_tokens + sum(d.num_tokens for d in r.docs) + r.question_tokens for r in measured
    )
    roots = sum(r.root_tokens for r in measured)
    doc_tokens = sum(d.num_tokens for r in measured for d in r.docs)
    engine_docs = max(0.0, engine_rate * prompt - roots) / doc_tokens if doc_tokens else 0.0
    return ReplayRow(
        workload=name,
        system=system,
        points=len(points),
        engine_token_hit_rate=engine_rate,
        engine_doc_token_hit_rate=engine_docs,
        sim=sim,
        engine_prompt_tokens_mean=statistics.fmean(p["prompt_tokens_mean"] for p in points),
        sim_prompt_tokens_mean=prompt / max(1, len(measured)),
        config=config,
        sim_host_tokens_mean=statistics.fmean(host) if host else 0.0,
        sim_both_tiers_tokens_mean=statistics.fmean(both) if both else 0.0,
        ceiling_doc_token_hit_rate=reuse_ceiling(requests, warmup),
    )


def print_rows(rows: list[ReplayRow], out: Any) -> None:
    """One line per system: engine and simulator, token and document-token hit rates, the
    stream's ceiling (`reuse_ceiling`), and the simulated host tier's mean tokens with the
    share vLLM's blocks hold too."""
    print(
        f"{'workload':<14} {'system':<22} {'pts':>3}  {'tokens eng/sim':>15}  "
        f"{'doc tokens eng/sim':>19}  {'gap':>6}  {'ceiling':>7}  {'prompt eng/sim':>15}  "
        f"{'host tokens (both tiers)':>24}",
        file=out,
    )
    for r in rows:
        host = r.sim_host_tokens_mean
        both = r.sim_both_tiers_tokens_mean / host if host else 0.0
        print(
            f"{r.workload:<14} {r.system:<22} {r.points:>3}  "
            f"{r.engine_token_hit_rate:>7.1%}/{r.sim.token_hit_rate:<7.1%}  "
            f"{r.engine_doc_token_hit_rate:>9.1%}/{r.sim.doc_token_hit_rate:<9.1%}  "
            f"{r.gap_points:>+5.1f}p  {r.ceiling_doc_token_hit_rate:>7.1%}  "
            f"{r.engine_prompt_tokens_mean:>7.0f}/{r.sim_prompt_tokens_mean:<7.0f}  "
            f"{host:>14,.0f} ({both:>5.1%})",
            file=out,
        )
