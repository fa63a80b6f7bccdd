"""DGDSF's frequency half-life, replayed: `ragcache simulate --replay` of a `bench serve` run
with `policy.FREQUENCY_HALF_LIFE` set to each given value (issue 55: the CPU default's
long-document stream, where recency pays and the default's 2,000 final requests do not).

    .venv/bin/python scripts/half_life_replay.py DIR/serve.json 2000 200 50 20 5

Prints `simulate --replay`'s table once per half-life (the host tier under DGDSF at that
half-life; the engine's columns stay the run's own).
"""

from __future__ import annotations

import sys

import ragcache_core.policy.base as policy_base
from ragcache_core.cli import main as ragcache


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    serve_json, half_lives = argv[0], [float(h) for h in argv[1:]]
    for half_life in half_lives:
        policy_base.FREQUENCY_HALF_LIFE = half_life  # read at every count (`NodeStats.touch`)
        print(f"== half-life {half_life:g} final requests", flush=True)
        code = ragcache(["simulate", "--replay", serve_json, "--replay-policy", "dgdsf"])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
