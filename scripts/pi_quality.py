"""Position-independent document reuse, its answer quality measured outside the engine (issue 58).

Before the engine can serve a document's KV at a position other than the one it was computed
at, one question decides the design: how much answer quality does that cost on the real model,
and how many tokens of each reused document must be recomputed (LegoLink, arXiv 2410.15332) to
keep the cost within the issue's budget (a mean F1 drop of at most 1 point, the upper end of its
95% paired-bootstrap interval at most 2)? This script answers it with transformers' implementation
of the same checkpoint (float32, greedy), on `bench quality`'s streams and prompts:

    exact      the root's KV, then the documents and the question computed in one forward (what
               the engine serves today)
    k=K        every node's *canonical* KV -- its document computed first after the root, the
               place the tree's first-level nodes already hold -- reused at its served position
               with its keys re-rotated by RoPE (values unchanged); for each node but the first,
               a link pass recomputes the tokens before the document's own (the previous
               document's held-back tail, `runtime/prompt.py`, and any head the tokenizer
               splits otherwise after it: the canonical ids are matched by their common
               suffix) and its first K tokens, attending to everything before them; then the
               question is computed
    k=Kb       the same, the link ending on the next 32-token block boundary (the engine's
               chained-pass route computes whole blocks: the effective K is K to K+31)
    k=all      the same assembly with every document token recomputed: a control that must agree
               with `exact` (only float32 summation order differs)

    .venv/bin/python scripts/pi_quality.py --stream squad --questions 300 --out /tmp/pi-squad
    .venv/bin/python scripts/pi_quality.py --report /tmp/pi-squad

Each question's replies go to DIR/replies.I.jsonl as they are made (`--shard I/N`: every N-th
question from the I-th, so that N processes of one thread each share the machine; a run can be
stopped, resumed, and its questions so far reported); the summary (`--report`, or at the end)
gives each variant's exact match, F1 and contains with their intervals, and against `exact`:
the paired F1 difference and the share of equal replies. The keys' re-rotation is checked
against layer 0, whose keys depend on the token and its position alone, on every document a
`k=0` variant moves whole.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicCache

from ragcache_core.bench.intervals import mean_interval, paired_difference, wilson
from ragcache_core.bench.quality import QUALITY_PROMPT
from ragcache_core.bench.quality_streams import QualityItem, load_stream
from ragcache_core.bench.scoring import normalize, score_reply
from ragcache_core.models import fetch_model
from ragcache_core.runtime.prompt import PromptBuilder

BLOCK = 32
"""vLLM's KV block on CPU: the engine's link passes end on its boundaries."""
MAX_TOKENS = 32
"""Answer tokens, as `bench quality`."""

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each [1, kv_heads, tokens, head_dim]."""


def extend(model: Any, cache: DynamicCache, ids: Sequence[int]) -> torch.Tensor:
    """Compute `ids` after what `cache` holds (appending their KV); the last position's logits."""
    out = model(input_ids=torch.tensor([list(ids)]), past_key_values=cache, use_cache=True)
    return out.logits[0, -1]


def append(cache: DynamicCache, kv: KV) -> None:
    for layer, (keys, values) in enumerate(kv):
        cache.update(keys, values, layer)


def cache_of(kv: KV) -> DynamicCache:
    cache = DynamicCache()
    append(cache, kv)
    return cache


def kv_of(cache: DynamicCache, start: int) -> KV:
    return [(layer.keys[:, :, start:], layer.values[:, :, start:]) for layer in cache.layers]


def common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many ids `a` and `b` end with in common."""
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def moved(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys RoPE-rotated at positions p, rotated on to p + `delta` (RoPE's rotations compose:
    R(p + d) = R(d) R(p); the same neox-style pairs (i, i + d/2) as the model's)."""
    angle = delta * inv_freq.to(torch.float64)  # [head_dim / 2]
    emb = torch.cat((angle, angle))  # [head_dim]
    cos, sin = emb.cos().to(keys.dtype), emb.sin().to(keys.dtype)
    return keys * cos + rotate_half(keys) * sin


def greedy(model: Any, cache: DynamicCache, logits: torch.Tensor, eos: set[int]) -> list[int]:
    out: list[int] = []
    token = int(logits.argmax())
    while token not in eos and len(out) < MAX_TOKENS:
        out.append(token)
        token = int(extend(model, cache, [token]).argmax())
    return out


class Measure:
    """One question's variants, on one model and prompt layout."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()
        self.builder = PromptBuilder(self.tokenizer, QUALITY_PROMPT, str(model_dir), "float32")
        self.inv_freq = self.model.model.rotary_emb.inv_freq
        scaling = getattr(self.model.model.rotary_emb, "attention_scaling", 1.0)
        if scaling != 1.0:
            raise SystemExit(f"RoPE with attention scaling {scaling}: not plain RoPE")
        self.eos = {int(self.model.generation_config.eos_token_id)}
        self.root: tuple[int, ...] | None = None
        self.root_kv: KV = []
        self.rotation_error = 0.0
        self.rotation_checks = 0

    def root_cache(self, root: tuple[int, ...]) -> DynamicCache:
        if root != self.root:
            cache = DynamicCache()
            extend(self.model, cache, root)
            self.root, self.root_kv = root, kv_of(cache, 0)
        return cache_of(self.root_kv)

    def canonical(
        self, item: QualityItem, index: int, root: tuple[int, ...]
    ) -> tuple[list[int], KV]:
        """Document `index`'s node ids and KV when it is first after the root."""
        alone = self.builder.build(item.question, [item.documents[index]])
        assert alone.root_ids == root, "the root depends on the documents"
        body = list(alone.doc_ids[0])
        cache = self.root_cache(root)
        extend(self.model, cache, body)
        return body, kv_of(cache, len(root))

    def question(self, item: QualityItem, variants: Sequence[str]) -> dict[str, Any]:
        built = self.builder.build(item.question, list(item.documents))
        root, nodes, rest = built.root_ids, built.doc_ids, built.question_ids
        with torch.inference_mode():
            replies: dict[str, list[int]] = {}
            link_tokens: dict[str, int] = {}
            canon = [self.canonical(item, i, root) for i in range(len(nodes))]
            for variant in variants:
                cache = self.root_cache(root)
                if variant == "exact":
                    logits = extend(self.model, cache, [t for n in nodes for t in n] + list(rest))
                    link_tokens[variant] = 0
                else:
                    linked = self.assemble(cache, root, nodes, canon, variant)
                    link_tokens[variant] = linked
                    logits = extend(self.model, cache, rest)
                replies[variant] = greedy(self.model, cache, logits, self.eos)
        return {
            "id": item.id,
            "gold_position": item.gold_position,
            "answers": list(item.answers),
            "prompt_tokens": len(built.token_ids),
            "node_tokens": [len(n) for n in nodes],
            "link_tokens": link_tokens,
            "replies": {v: self.decode(ids) for v, ids in replies.items()},
            "reply_ids": replies,
        }

    def assemble(
        self,
        cache: DynamicCache,
        root: tuple[int, ...],
        nodes: Sequence[Sequence[int]],
        canon: Sequence[tuple[list[int], KV]],
        variant: str,
    ) -> int:
        """Fill `cache` after the root as `variant` serves the nodes; the link tokens computed."""
        spec = variant.removeprefix("k=")
        aligned = spec.endswith("b")
        k = math.inf if spec == "all" else int(spec.removesuffix("b"))
        linked = 0
        for index, node in enumerate(nodes):
            body, kv = canon[index]
            start = cache.get_seq_length()
            common = common_suffix(node, body)
            if common == 0:
                extend(self.model, cache, node)  # nothing of it in the canonical ids: computed
                linked += len(node)
                continue
            foreign = len(node) - common  # served first, not in the canonical ids
            offset = len(body) - common  # canonical ids not served (a head tokenized otherwise)
            if index == 0 and foreign == offset == 0:
                append(cache, kv)  # the canonical place itself: exact
                continue
            link = len(node) if k == math.inf else min(len(node), foreign + int(k))
            if aligned and link < len(node):
                link = min(len(node), -(-(start + link) // BLOCK) * BLOCK - start)
            if link:
                extend(self.model, cache, node[:link])
                linked += link
            if link < len(node):
                first = offset + link - foreign  # the first canonical token reused
                delta = start + link - (len(root) + first)
                part = [
                    (moved(keys[:, :, first:], delta, self.inv_freq), values[:, :, first:])
                    for keys, values in kv
                ]
                if link == foreign:
                    self.check_rotation(node, start, part)
                append(cache, part)
        return linked

    def check_rotation(self, node: Sequence[int], start: int, part: KV) -> None:
        """Layer 0's keys depend on the token and its position alone: the moved canonical keys
        must equal the keys computed at the served position."""
        cache = DynamicCache()
        ids = list(node)
        positions = torch.arange(start, start + len(ids))[None]
        self.model(input_ids=torch.tensor([ids]), position_ids=positions, past_key_values=cache)
        direct = cache.layers[0].keys
        error = float((direct[:, :, -part[0][0].shape[2] :] - part[0][0]).abs().max())
        self.rotation_error = max(self.rotation_error, error)
        self.rotation_checks += 1

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True)).strip()


def read_rows(folder: Path) -> list[dict[str, Any]]:
    """Every shard's replies in `folder`, in question order (by the stream's sample order)."""
    rows = [
        json.loads(line)
        for path in sorted(folder.glob("replies.*.jsonl"))
        for line in path.read_text().splitlines()
        if line
    ]
    return sorted(rows, key=lambda r: r["n"])


def report(rows: Sequence[dict[str, Any]], variants: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"questions": len(rows), "variants": {}}
    scores = {v: [score_reply(r["replies"][v], r["answers"]) for r in rows] for v in variants}
    for v in variants:
        entry: dict[str, Any] = {}
        for figure in ("exact_match", "f1", "contains"):
            entry[figure] = mean_interval([s[figure] for s in scores[v]]).to_json()
        entry["link_tokens_mean"] = sum(r["link_tokens"][v] for r in rows) / len(rows)
        if v != "exact" and "exact" in variants:
            entry["f1_minus_exact"] = paired_difference(
                [s["f1"] for s in scores[v]], [s["f1"] for s in scores["exact"]]
            ).to_json()
            entry["same_reply_as_exact"] = wilson(
                [
                    float(normalize(r["replies"][v]) == normalize(r["replies"]["exact"]))
                    for r in rows
                ]
            ).to_json()
            entry["identical_ids"] = sum(r["reply_ids"][v] == r["reply_ids"]["exact"] for r in rows)
            by_position: dict[str, Any] = {}
            for position in sorted({r["gold_position"] for r in rows} - {None}):
                picked = [i for i, r in enumerate(rows) if r["gold_position"] == position]
                by_position[str(position)] = paired_difference(
                    [scores[v][i]["f1"] for i in picked], [scores["exact"][i]["f1"] for i in picked]
                ).to_json() | {"questions": len(picked)}
            entry["f1_minus_exact_by_gold_position"] = by_position
        out["variants"][v] = entry
    return out


def print_report(summary: dict[str, Any]) -> None:
    print(f"{summary['questions']} questions")
    print(
        f"{'variant':8} {'EM':>6} {'F1':>6} {'contains':>8} {'F1 - exact [95%]':>24} "
        f"{'same reply':>10} {'same ids':>8} {'link tok':>8}"
    )
    for v, e in summary["variants"].items():
        diff = e.get("f1_minus_exact")
        d = "-"
        if diff:
            low, high = diff["ci95"]
            d = f"{100 * diff['value']:+.2f} [{100 * low:+.2f}, {100 * high:+.2f}]"
        same = f"{100 * e['same_reply_as_exact']['value']:.1f}%" if diff else "-"
        print(
            f"{v:8} {100 * e['exact_match']['value']:6.1f} {100 * e['f1']['value']:6.1f} "
            f"{100 * e['contains']['value']:8.1f} {d:>24} {same:>10} "
            f"{e.get('identical_ids', '-')!s:>8} {e['link_tokens_mean']:8.1f}"
        )


def print_positions(summary: dict[str, Any]) -> None:
    for v, e in summary["variants"].items():
        parts = [
            f"gold at {p} ({d['questions']}): {100 * d['value']:+.2f} "
            f"[{100 * d['ci95'][0]:+.2f}, {100 * d['ci95'][1]:+.2f}]"
            for p, d in e.get("f1_minus_exact_by_gold_position", {}).items()
        ]
        if parts:
            print(f"{v:8} F1 - exact by " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stream", default="squad", choices=("squad", "nq"))
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="exact,k=0,k=16,k=16b,k=32,k=all")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/pi-quality"))
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th question from the I-th")
    parser.add_argument("--report", type=Path, default=None, help="summarize a run's folder")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if args.report is not None:
        rows = read_rows(args.report)
        summary = report(rows, [v for v in variants if all(v in r["replies"] for r in rows)])
        print_report(summary)
        print_positions(summary)
        return
    shard, shards = (int(x) for x in args.shard.split("/"))
    torch.set_num_threads(args.threads)
    model_dir = args.model or fetch_model("smollm2-135m-instruct")
    stream = load_stream(args.stream, args.questions, seed=args.seed)
    measure = Measure(model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"replies.{shard}.jsonl"
    done = (
        {json.loads(line)["id"] for line in path.read_text().splitlines()}
        if path.exists()
        else set()
    )
    started = time.perf_counter()
    with path.open("a") as sink:
        for n, item in enumerate(stream.items):
            if item.id in done or n % shards != shard:
                continue
            row = {"n": n} | measure.question(item, variants)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            print(
                f"{n + 1}/{len(stream.items)} {time.perf_counter() - started:.0f}s "
                f"rotation error {measure.rotation_error:.2e}",
                file=sys.stderr,
                flush=True,
            )
    if shards > 1:
        return  # `--report DIR` once every shard is done
    rows = read_rows(args.out)
    summary = report(rows, variants) | {
        "stream": args.stream,
        "seed": args.seed,
        "model": str(model_dir),
        "rotation_error_max": measure.rotation_error,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_report(summary)
    print_positions(summary)


if __name__ == "__main__":
    main()
