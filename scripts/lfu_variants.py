"""LFU variants against the best fixed policy, per cell of `policy_hit_rates.py` (issue 39):
an experiment, the variants are registered here only (the default policy is unchanged).

  * `lfu`: as shipped, frequency then recency;
  * `lfu-da`: LFU with dynamic aging (Clock[tier] + frequency, the clock as GDSF's);
  * `lfu-age4`: the same aging at a quarter of the pace;
  * `lfu-size`: Clock[tier] + frequency / size;
  * `lfu-per-token`: frequency / size, no aging, then recency.

    .venv/bin/python scripts/lfu_variants.py /tmp/ragcache-traces/*.jsonl --host-write compute
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_hit_rates import FIXED, cell_arguments, grid, print_shares, simulate_cell

from ragcache_core.plan import Tier
from ragcache_core.policy import POLICIES, GreedyDualPolicy, NodeStats, Priority


class LFUDA(GreedyDualPolicy):
    name = "lfu-da"

    def cost_per_token(self, stats: NodeStats) -> float:
        return 1.0


class LFUAge4(LFUDA):
    name = "lfu-age4"

    def on_evict(self, tier: Tier, priority: Priority) -> None:
        clock = self.clocks[tier]
        self.clocks[tier] = max(clock, clock + 0.25 * (priority[0] - clock))


class LFUSize(GreedyDualPolicy):
    name = "lfu-size"

    def cost_per_token(self, stats: NodeStats) -> float:
        return 1.0 / max(stats.num_tokens, 1)


class LFUPerToken(LFUDA):
    name = "lfu-per-token"

    def priority(self, stats: NodeStats, tier: Tier) -> Priority:
        return (stats.frequency / max(stats.num_tokens, 1), float(stats.last_access))


VARIANTS = (LFUDA, LFUAge4, LFUSize, LFUPerToken)


def main() -> None:
    parser = cell_arguments()
    args = parser.parse_args()
    for cls in VARIANTS:
        POLICIES[cls.name] = cls
    names = ("lfu", *(cls.name for cls in VARIANTS))
    worst = {name: (float("inf"), "") for name in names}
    print("| trace | host | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for path, requests, gpu, fraction, host in grid(args.traces, args.gpu_fraction):
        rates = {
            p: simulate_cell(
                requests, gpu, host, p, args.system_tokens, host_write=args.host_write
            ).doc_hit_rate
            for p in dict.fromkeys((*FIXED, *names))
        }
        best = max(rates[p] for p in FIXED)
        print_shares(path, fraction, {p: rates[p] / best if best else 1.0 for p in names}, worst)
    for p, (share, where) in worst.items():
        print(f"{p}: lowest share of the best fixed policy {share:.3f} ({where})")


if __name__ == "__main__":
    main()
