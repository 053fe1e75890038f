"""``python -m bench monarch``: who notices a lost node first on Monarch, Monarch's supervision or ftrt.

A :class:`ftrt.integrations.monarch.MonarchGroup` of 3 nodes (single-process meshes on this machine)
trains the regression example; each trial SIGKILLs one node's host process (its agent and worker die
with it) between two steps, then calls the next step. Measured from the kill:

- **call**: until that step returns at the smaller world (the survivors took ftrt's next round);
- **monarch**: until Monarch's supervision reports the host's mesh failed (the fault hook).

Once with Monarch's default supervision poll and once with the group's (``200ms``), each in a fresh
process (the poll is read when Monarch's runtime starts). A node is added back after each trial.

    python -m bench monarch --trials 3 --out docs/bench/monarch-20261206.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

SETTINGS = ("default", "200ms")


def child(poll: str, trials: int) -> list[dict]:
    from ftrt.integrations.monarch import MonarchGroup

    batch = 12
    results, step = [], 0
    with MonarchGroup("ftrt.examples.ray_regression:Regression", nodes=3, min_nodes=1, max_nodes=3,
                      supervision_poll=None if poll == "default" else poll) as group:
        for trial in range(trials):
            while group.world_size < 3:  # the node added back after the last trial joins
                group.call("train", step, list(range(step * batch, (step + 1) * batch)))
                step += 1
            for _ in range(3):
                group.call("train", step, list(range(step * batch, (step + 1) * batch)))
                step += 1
            victim = group.status()[-1]
            os.kill(victim["host_pid"], signal.SIGKILL)
            t0 = time.monotonic()
            res = group.call("train", step, list(range(step * batch, (step + 1) * batch)))
            call_s = time.monotonic() - t0
            step += 1
            deadline = t0 + 20
            seen = None
            while seen is None and time.monotonic() < deadline:
                seen = next((t for t, line in group.placement.failures if t >= t0 and "ftrt_host" in line), None)
                time.sleep(0.01)
            results.append({"poll": poll, "trial": trial, "world": res.world_size, "call_s": round(call_s, 4),
                            "monarch_s": round(seen - t0, 4) if seen is not None else None})
            group.status()  # drops the lost host
            group.add_node()
    return results


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench monarch", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--out", help="write the results here (JSON)")
    p.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.trials)), flush=True)
        return 0
    rows = []
    for poll in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k != "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"}
        out = subprocess.run([sys.executable, "-m", "bench", "monarch", "--child", poll, "--trials", str(args.trials)],
                             capture_output=True, text=True, timeout=600, env=env)
        if out.returncode != 0:
            print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
            return 1
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'supervision poll':>16}  {'trial':>5}  {'world':>5}  {'call returned':>13}  {'Monarch reported':>16}")
    for r in rows:
        mon = f"{r['monarch_s']:.3f} s" if r["monarch_s"] is not None else "not in 20 s"
        print(f"{r['poll']:>16}  {r['trial']:>5}  {r['world']:>5}  {r['call_s']:>11.3f} s  {mon:>16}")
    for poll in SETTINGS:
        mine = [r for r in rows if r["poll"] == poll]
        seen = [r["monarch_s"] for r in mine if r["monarch_s"] is not None]
        print(f"{poll}: call returned after {statistics.median(r['call_s'] for r in mine):.3f} s (median); Monarch "
              f"reported after {statistics.median(seen):.3f} s" if seen else "Monarch did not report")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "command": "python -m bench monarch " + " ".join(argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
