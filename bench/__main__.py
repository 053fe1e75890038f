"""``python -m bench NAME [options]``: run one benchmark, or ``all`` (the set that fits in ~15 minutes).

``all`` runs each benchmark with smaller settings than its own defaults (fewer repeats, shorter
schedules; listed in :data:`QUICK`), so the whole set takes about 15 minutes on 2 cores. The
numbers in docs/benchmarks.md come from each benchmark's full settings, with the command beside
them.
"""

from __future__ import annotations

import importlib
import sys
import time

from ftrt import progress

NAMES = {
    "rdzv_scale": "bench.rdzv_scale", "overhead": "bench.overhead", "goodput": "bench.goodput",
    "recovery": "bench.recovery", "ckpt_stall": "bench.ckpt_stall", "restore": "bench.restore",
    "rollout": "bench.rollout", "rollout_fleet": "bench.rollout_fleet",
    "trainers": "bench.trainers", "memsave": "bench.memsave", "ray": "bench.ray_elastic",
    "monarch": "bench.monarch_loss",
}
QUICK: dict[str, list[str]] = {
    "rdzv_scale": ["--sizes", "16,64,256", "--torchrun-sizes", "16,64", "--c10d", "best", "--cap", "30"],
    "overhead": ["--reps", "1", "--steps", "120"],
    "goodput": ["--duration", "150", "--plot", "bench/results/goodput-quick.png"],
    "recovery": ["--reps", "1", "--scenario", "node_loss", "--scenario", "node_join", "--no-torchrun-defaults"],
    "ckpt_stall": ["--gib", "0.25", "--steps", "45"],
    "restore": ["--gib", "0.25"],
    "rollout": ["--repeats", "5"],
    "rollout_fleet": ["--pushes", "3", "--steps", "25", "--storm-steps", "80"],
    "trainers": ["--reps", "1", "--steps", "25"],
    "memsave": ["--saves", "50"],
    "ray": ["--duration", "100", "--every", "45", "--down", "15"],
    "monarch": ["--trials", "2"],
}
"""Each benchmark's settings in ``all``."""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*NAMES, "all"):
        print(__doc__.splitlines()[0].replace("``", ""))
        print(f"usage: python -m bench {{{','.join(NAMES)},all}} [options]  (NAME --help: its options)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] != "all":
        return importlib.import_module(NAMES[argv[0]]).main(argv[1:])
    failed, t0 = [], time.time()
    with progress.bar(len(QUICK), "benchmarks", "bench") as shown:
        for name, args in QUICK.items():
            print(f"\n=== python -m bench {name} {' '.join(args)}  ({(time.time() - t0) / 60:.1f} min so far)",
                  flush=True)
            try:
                code = importlib.import_module(NAMES[name]).main(args)
            except Exception as exc:  # noqa: BLE001 - one benchmark failing must not hide the others' numbers
                print(f"bench {name} failed: {type(exc).__name__}: {exc}", flush=True)
                code = 1
            if code:
                failed.append(name)
            shown.update()
    print(f"\nall: {len(QUICK) - len(failed)} of {len(QUICK)} benchmarks ran in {(time.time() - t0) / 60:.1f} min"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
