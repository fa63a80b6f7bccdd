"""The live cache follows full-policy shadows (issue 39): an experiment, registered here only
(the default policy is unchanged).

Each shadow is a whole simulated engine (`sim.engine.EngineSimulator`: vLLM's blocks and the
host `KnowledgeTree`, same capacities) under one fixed policy (pgdsf, gdsf, lru, lfu, arc),
served the same requests in the same order as the live engine, so it is prefix-aware by
construction: its tree evicts leaves only and its documents hit only under their whole
prefix. A shadow's results are those of its fixed policy run alone (the shadows never read the
live cache), so one pass gives the best fixed policy of a cell too.

The live engine's policy, `Follower`, holds one instance of each fixed policy, fed every hook
the live tree gives (each priority call, copies entering and leaving, evictions: a sub-policy
hears each eviction with its own priority snapshot of the victim, so GDSF's clock moves as
that policy values what was evicted), and hands the tree the priority of the current leader.
After each request the chooser updates each shadow's score, its document hits (GPU or host)
decayed by `decay` per request, and makes the shadow with the highest score the leader when
its score is more than (1 + `margin`) x the current leader's. At a switch every host copy in
the live tree is offered again with the new leader's snapshot of it (taken at its last
access, as that policy stores it), so the candidates are ranked on one scale; the cache's
contents stay (the engine cannot move KV), only its eviction decisions change. The candidates
are kept in lanes (ARC's T1 and T2; every other policy in lane 0), the leader's lanes first.

Variant names: `follow{decay}m{margin}[z{z}][p][s{start}]`, e.g. `follow0.999m0.02` (start:
a fixed policy's name, default pgdsf). `z`: a switch also needs the lead to exceed z standard
deviations of the lead were the two shadows equal (a decayed paired test: the variance is the
sum of the squared per-request hit differences, each weighted decay^(2 x age)). `p` (pull):
a live copy the leader's shadow does not hold goes before those it holds (in its lane). `t`
(transplant): a live copy's priority is at least the one the leader's shadow stores for the
same prefix when it holds it (metadata only: the shadow's frequency or recency, read when the
copy's priority is taken). The shadows serve each request before the live engines (they are
metadata, run as the request arrives; the live engine's plan already knows its documents).

The choice (recorded before the held-out SQuAD traces were run): tuned on nq_top2, mmlu_top2
and nq/mmlu top-1 and top-4 (60 cells: 6 traces x 5 hosts x 2 write modes), ranked by the lowest
share of the best fixed policy; `follow0.999m0z2slfu` won (0.921, nq_top4 at 10% with
write-through; 33 of 60 below 0.99); `follow0.999m0` (0.903 at worst, but the fewest cells
below 0.99: 24) is run beside it, not as a choice. Last round: follow0.999m0 0.903 (24 below 0.99),
follow1m0z1slfu 0.873 (34), follow1m0z2slfu 0.905 (32), follow1m0z3slfu 0.917 (28),
follow0.999m0z2slfu 0.921 (33), follow0.9999m0z2slfu 0.906 (32). Earlier rounds (margins,
pull, transplant, starting at pgdsf with a test) did worse; none is within 1% everywhere.
Held out (squad_top2, squad_top3: `build_sim_traces.py --streams squad`, run once after the
choice): every cell of both at 0.996 or above, both modes; but there the default pgdsf alone
is at 0.992 or above in every cell too, so those traces do not tell the variants apart.

    .venv/bin/python scripts/shadow_follow.py /tmp/ragcache-traces/{nq_top2,mmlu_top2}.jsonl \\
        --host-write eviction --variants follow0.999m0,follow0.9999m0.02
"""

from __future__ import annotations

import re
import sys
from collections.abc import Hashable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_hit_rates import BLOCK_SIZE, FIXED, cell_arguments, engine_blocks, grid, print_shares

from ragcache_core.plan import Tier
from ragcache_core.policy import POLICIES, EvictionPolicy, NodeStats, Priority, make_policy
from ragcache_core.sim import EngineConfig, EngineRequest, EngineSimulator

LANE0 = 0.0
"""The lane of every candidate whose leader keeps no lanes."""


class Follower(EvictionPolicy):
    """Every fixed policy's state, kept on the live tree; the tree ranks by the leader's."""

    name = "follow"
    tracks_residency = True
    lanes = True

    START = "pgdsf"
    PULL = False
    TRANSPLANT = False

    def __init__(self) -> None:
        self.subs = [make_policy(n) for n in FIXED]
        self.leader = FIXED.index(self.START)
        self.held: list[set[Hashable]] = [set() for _ in FIXED]
        """Per shadow, the keys its host tier holds (set by the script; read with `PULL`)."""
        self.keys: dict[int, Hashable] = {}
        self.shadow_trees: list = []
        """Per shadow, its tree (set by the script; read with `TRANSPLANT`)."""
        self.snapshots: dict[Tier, dict[int, list[Priority] | None]] = {
            Tier.GPU: {},
            Tier.HOST: {},
        }
        self.switches = 0

    def wrap(self, index: int, priority: Priority, key: Hashable = None) -> Priority:
        """Sub-policy `index`'s priority as the tree stores it: (lane, held, its two elements),
        `held` 0 for a copy of `key` that shadow `index` does not hold (with `PULL`: those go
        first in their lane), else 1."""
        held = 1.0
        if self.PULL and key is not None and key not in self.held[index]:
            held = 0.0
        if self.TRANSPLANT and key is not None:
            priority = max(priority, self.shadow_priority(index, key) or priority)
        if self.subs[index].lanes:
            return (priority[0], held, priority[1], 0.0)  # type: ignore[return-value]
        return (LANE0, held, priority[0], priority[1])  # type: ignore[return-value]

    def shadow_priority(self, index: int, key: Hashable) -> Priority | None:
        """The priority shadow `index`'s host tier stores for `key`, if it holds it."""
        prefixes = self.shadow_trees[index]._placement._prefixes
        path = prefixes.walk(key[1:], key[0])  # type: ignore[index]
        if len(path) != len(key) - 1 or Tier.HOST not in path[-1].slots:  # type: ignore[arg-type]
            return None
        return path[-1].priority.get(Tier.HOST)

    def priority(self, stats: NodeStats, tier: Tier) -> Priority:
        snaps = [sub.priority(stats, tier) for sub in self.subs]
        resident = self.snapshots[tier]
        key = None
        if id(stats) in resident:
            resident[id(stats)] = snaps
            key = self.keys.get(id(stats)) if tier is Tier.HOST else None
        return self.wrap(self.leader, snaps[self.leader], key)

    def on_enter(self, tier: Tier, key: Hashable, stats: NodeStats) -> None:
        self.snapshots[tier][id(stats)] = None
        if tier is Tier.HOST:
            self.keys[id(stats)] = key
        for sub in self.subs:
            if sub.tracks_residency:
                sub.on_enter(tier, key, stats)

    def on_leave(self, tier: Tier, key: Hashable, stats: NodeStats, *, evicted: bool) -> None:
        snaps = self.snapshots[tier].pop(id(stats), None)
        if tier is Tier.HOST:
            self.keys.pop(id(stats), None)
        for i, sub in enumerate(self.subs):
            if evicted and snaps is not None:
                sub.on_evict(tier, snaps[i])
            if sub.tracks_residency:
                sub.on_leave(tier, key, stats, evicted=evicted)

    def lane_order(self, tier: Tier) -> tuple[float, ...]:
        lead = self.subs[self.leader]
        if lead.lanes:
            return (*lead.lane_order(tier), LANE0)
        return (LANE0, 1.0, 2.0)

    def reset(self) -> None:
        for sub in self.subs:
            sub.reset()
        self.snapshots = {Tier.GPU: {}, Tier.HOST: {}}
        self.keys = {}


class Tracked:
    """Mixin for a shadow's policy: records the keys its host tier holds, and which changed."""

    tracks_residency = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[call-arg]
        self.held: set[Hashable] = set()
        self.changed: set[Hashable] = set()

    def on_enter(self, tier: Tier, key: Hashable, stats: NodeStats) -> None:
        super().on_enter(tier, key, stats)  # type: ignore[misc]
        if tier is Tier.HOST:
            self.held.add(key)
            self.changed.add(key)

    def on_leave(self, tier: Tier, key: Hashable, stats: NodeStats, *, evicted: bool) -> None:
        super().on_leave(tier, key, stats, evicted=evicted)  # type: ignore[misc]
        if tier is Tier.HOST:
            self.held.discard(key)
            self.changed.add(key)


def tracked(name: str) -> str:
    """Register fixed policy `name` with `Tracked`; the registry name to build it by."""
    base = POLICIES[name]
    POLICIES[f"{name}@shadow"] = type(f"{name}@shadow", (Tracked, base), {"name": name})
    return f"{name}@shadow"


def repull(sim: EngineSimulator, follower: Follower, keys: set[Hashable]) -> None:
    """The leader's shadow took or dropped `keys`: offer the live copies of those again."""
    placement = sim.tree._placement
    host = placement.tiers[Tier.HOST]
    snapshots = follower.snapshots[Tier.HOST]
    leader = follower.leader
    for key in keys:
        path = placement._prefixes.walk(key[1:], key[0])  # type: ignore[index]
        if len(path) != len(key) - 1:  # type: ignore[arg-type]
            continue
        node = path[-1]
        snaps = snapshots.get(id(node.stats))
        if Tier.HOST not in node.slots or snaps is None:
            continue
        node.priority[Tier.HOST] = follower.wrap(leader, snaps[leader], key)
        host.push(node)


def switch(sim: EngineSimulator, follower: Follower, leader: int) -> None:
    """Make `leader` the live tree's policy: every host copy offered again with its snapshot.

    Reaches into the tree's placement (an experiment's shortcut: the library has no hook that
    re-ranks stored priorities)."""
    follower.leader = leader
    follower.switches += 1
    placement = sim.tree._placement
    host = placement.tiers[Tier.HOST]
    snapshots = follower.snapshots[Tier.HOST]
    for node in placement._prefixes.iter_nodes():
        if Tier.HOST not in node.slots:
            continue
        snaps = snapshots.get(id(node.stats))
        if snaps is None:
            continue
        key = follower.keys.get(id(node.stats))
        node.priority[Tier.HOST] = follower.wrap(leader, snaps[leader], key)
        host.push(node)


VARIANT = re.compile(
    r"follow(?P<decay>[0-9.]+)m(?P<margin>[0-9.]+)(?:z(?P<z>[0-9.]+))?(?P<pull>p)?(?P<transplant>t)?"
    r"(?:s(?P<start>[a-z]+))?"
)


class Chooser:
    """One variant's rule: decayed document hits per shadow, a switch past the margin."""

    def __init__(self, spec: str) -> None:
        match = VARIANT.fullmatch(spec)
        if match is None:
            raise SystemExit(
                f"unknown variant {spec!r} (follow{{decay}}m{{margin}}[z{{z}}][p][t][s{{start}}])"
            )
        self.name = spec
        self.decay = float(match["decay"])
        self.margin = float(match["margin"])
        self.start = match["start"] or "pgdsf"
        self.pull = bool(match["pull"])
        self.transplant = bool(match["transplant"])
        self.z = float(match["z"] or 0)
        self.scores = [0.0] * len(FIXED)
        n = len(FIXED)
        self.variance = [[0.0] * n for _ in range(n)]
        """Per pair of shadows: the sum of their per-request hit differences squared, each
        weighted decay^(2 x age): the variance of their decayed lead were they equal."""

    def update(self, hits: list[int], current: int) -> int:
        """Add one request's hits per shadow; the leader to follow from now."""
        self.scores = [s * self.decay + h for s, h in zip(self.scores, hits, strict=True)]
        if self.z:
            square = self.decay * self.decay
            for i, row in enumerate(self.variance):
                for j in range(i + 1, len(hits)):
                    row[j] = row[j] * square + (hits[i] - hits[j]) ** 2
        best = max(range(len(hits)), key=lambda i: self.scores[i])
        if best == current:
            return current
        lead = self.scores[best] - self.scores[current]
        if lead <= self.margin * self.scores[current]:
            return current
        if self.z and lead <= self.z * self.variance[min(best, current)][max(best, current)] ** 0.5:
            return current
        return best


def engine(requests, gpu: int, host: int, system_tokens: int, host_write: str, policy: str):
    config = EngineConfig(
        vllm_blocks=engine_blocks(requests, gpu, system_tokens),
        host_tokens=host,
        block_size=BLOCK_SIZE,
        policy=policy,
        host_write=host_write,
    )
    return EngineSimulator(config)


def run_cell(
    requests, gpu: int, host: int, system_tokens: int, host_write: str, specs: list[str]
) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """One cell: the fixed policies' document hit rates (the shadows), each variant's, and
    each variant's switches."""
    ordered = [
        EngineRequest.from_trace(r, system_tokens)
        for r in sorted(requests, key=lambda r: r.arrival_s)
    ]
    shadows = [engine(requests, gpu, host, system_tokens, host_write, tracked(p)) for p in FIXED]
    held = [sim.tree.policy.held for sim in shadows]  # type: ignore[attr-defined]
    choosers = [Chooser(s) for s in specs]
    for chooser in choosers:
        attrs = {
            "name": chooser.name,
            "START": chooser.start,
            "PULL": chooser.pull,
            "TRANSPLANT": chooser.transplant,
        }
        POLICIES[chooser.name] = type(chooser.name, (Follower,), attrs)
    lives = [engine(requests, gpu, host, system_tokens, host_write, s) for s in specs]
    followers: list[Follower] = [sim.tree.policy for sim in lives]  # type: ignore[misc]
    for follower in followers:
        follower.held = held
        follower.shadow_trees = [sim.tree for sim in shadows]
    shadow_served: list[list] = [[] for _ in FIXED]
    live_served: list[list] = [[] for _ in specs]
    for request in ordered:
        hits = []
        for i, sim in enumerate(shadows):
            served = sim.serve(request)
            shadow_served[i].append(served)
            hits.append(served.gpu_docs + served.host_docs)
        for j, sim in enumerate(lives):
            live_served[j].append(sim.serve(request))
        for sim, chooser, follower in zip(lives, choosers, followers, strict=True):
            leader = chooser.update(hits, follower.leader)
            if leader != follower.leader:
                switch(sim, follower, leader)
            elif chooser.pull:
                repull(sim, follower, shadows[leader].tree.policy.changed)  # type: ignore[attr-defined]
        for sim in shadows:
            sim.tree.policy.changed.clear()  # type: ignore[attr-defined]
    fixed = {p: shadows[i].result(shadow_served[i]).doc_hit_rate for i, p in enumerate(FIXED)}
    live = {s: lives[j].result(live_served[j]).doc_hit_rate for j, s in enumerate(specs)}
    switches = {s: followers[j].switches for j, s in enumerate(specs)}
    return fixed, live, switches


def main() -> None:
    parser = cell_arguments()
    parser.add_argument("--variants", default="follow0.999m0.02")
    parser.add_argument("--tuned", default="", help="tuning traces (stems)")
    args = parser.parse_args()
    specs = args.variants.split(",")
    tuned = set(args.tuned.split(","))
    worst: dict[bool, dict[str, tuple[float, str]]] = {True: {}, False: {}}
    below: dict[bool, dict[str, int]] = {True: {}, False: {}}
    print(f"host_write={args.host_write}")
    print("| trace | host | " + " | ".join([*FIXED, *specs]) + " |")
    print("|---|---|" + "---|" * (len(FIXED) + len(specs)))
    for path, requests, gpu, fraction, host in grid(args.traces, args.gpu_fraction):
        fixed, live, switches = run_cell(
            requests, gpu, host, args.system_tokens, args.host_write, specs
        )
        best = max(fixed.values())
        shares = {p: r / best if best else 1.0 for p, r in {**fixed, **live}.items()}
        role = path.stem in tuned
        print_shares(path, fraction, shares, worst[role])
        for s in specs:
            below[role][s] = below[role].get(s, 0) + (shares[s] < 0.99)
        print(f"  best {best:.4f}; switches " + ", ".join(f"{s}={n}" for s, n in switches.items()))
    for role, lowest in worst.items():
        name = "tuning" if role else "held-out"
        for p, (share, where) in lowest.items():
            n = below[role].get(p)
            extra = f", {n} cells below 0.99" if n is not None else ""
            print(f"{p} on {name} traces: lowest share {share:.4f} ({where}){extra}")


if __name__ == "__main__":
    main()
