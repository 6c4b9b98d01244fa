"""Why some landscapes favour local search: the basins of first-improvement descent.

A descent starts at a config that measured, measures its neighbours (``Space.neighbours``, in
order) and moves to the first faster one, until none is: the polish of
:mod:`autotune.samplers.engine`, from any start instead of the best. Per landscape it prints

- the share of configs whose descent ends within 1% of the optimum (the optimum's basin): the
  chance that a descent from a uniformly random start finds the optimum;
- the configs one descent measures (median over ``--starts`` random starts);
- the median score (optimum / time) of the configs in the optimum's basin, and of all configs.

A large basin whose configs are slower than most is written off by the models (TPE, the
forest) after a few samples, though one descent in four from a random start would reach its
optimum: convolution-W6600 (its optimum's basin: 27% of the configs, median score 0.011 against
0.031 for all; the configs TPE settles on score 0.836 and sit in other basins). Kernel Tuner's
``dual_annealing``, local searches from random starts, beats our searcher's mean there at 50
and 100 configs (bench/search/replay.py) and on no other landscape. Where its searches go matters as
much as that they are local: its minimiser's steps end on the bounds of the ranges, and W6600's
optimum takes an end value in 3 of its 4 multi-valued parameters (bench/search/searcher-variants.md:
an edge-biased start matches its lead there and costs convolution-A100, whose optimum is
interior).

    python bench/search/basins.py [LANDSCAPE_DIR] [--starts 500]
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from autotune.landscape import Landscape, load_landscape
from autotune.searchspace import Key

NEAR_OPTIMUM = 0.99  # a descent that ends at this score or more found the optimum


def _step(land: Landscape, times: dict[Key, float | None], key: Key, seen: set[Key]) -> Key | None:
    """The first neighbour of ``key`` that is faster, or None (``key`` is a local optimum).
    The neighbours looked at are added to ``seen``; those already in it are skipped: one that
    was not faster than an earlier step of the descent is not faster than this one."""
    space = land.space
    for neighbour in space.neighbours(dict(zip(space.names, key, strict=True))):
        other = space.key(neighbour)
        if other in seen:
            continue
        seen.add(other)
        if times[other] is not None and times[other] < times[key]:
            return other
    return None


def _cost(land: Landscape, times: dict[Key, float | None], start: Key) -> int:
    """The configs a descent from ``start`` measures."""
    current, seen = start, {start}
    while current is not None:
        current = _step(land, times, current, seen)
    return len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("landscapes", nargs="?",
                        default=str(Path(__file__).resolve().parent / "landscapes"))
    parser.add_argument("--starts", type=int, default=500, help="random starts for the cost")
    args = parser.parse_args()
    print("| landscape | optimum's basin (share of configs) | configs per descent (median) "
          "| median score in the basin | median score of all |")
    print("|---|---|---|---|---|")
    for path in sorted(Path(args.landscapes).glob("*.json.gz")):
        land = load_landscape(path)
        space = land.space
        times = {key: land.measure(dict(zip(space.names, key, strict=True))).value
                 for key in land.records}
        measured = [key for key, t in times.items() if t is not None]
        ends: dict[Key, Key] = {}  # where the descent from a config ends
        for key in measured:
            path_keys, seen = [], {key}
            while key not in ends:
                path_keys.append(key)
                nxt = _step(land, times, key, seen)
                if nxt is None:
                    ends[key] = key
                else:
                    key = nxt
            ends.update(dict.fromkeys(path_keys, ends[key]))
        basin = [k for k in measured if land.score(times[ends[k]]) >= NEAR_OPTIMUM]
        rng = random.Random(0)
        costs = [_cost(land, times, rng.choice(measured)) for _ in range(args.starts)]
        scores = {k: land.score(times[k]) for k in measured}
        basin_score = statistics.median(scores[k] for k in basin) if basin else 0.0
        print(f"| {land.name} | {len(basin) / len(measured):.3f} | {statistics.median(costs):.0f} "
              f"| {basin_score:.3f} | {statistics.median(scores.values()):.3f} |")


if __name__ == "__main__":
    main()
