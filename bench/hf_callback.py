"""The per-step cost of ftrt in a Hugging Face Trainer: the same script under torchrun without ftrt
and under ``ftrt launch`` with ``FtrtCallback`` (heartbeats, and a committed manifest and fenced
pointer for every checkpoint), 2 ranks on gloo, interleaved and repeated.

``ftrt/examples/hf_trainer.py`` (a tiny Llama) trains ``--steps`` steps, saving every
``--save-steps`` (both systems save alike: the Trainer's own ``checkpoint-N``); the step time is
the median gap between consecutive logged steps, from step 5 on (start-up excluded).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(system: str, save_steps: int, steps: int, work: Path) -> float:
    out, metrics = work / f"{system}-out", work / f"{system}.jsonl"
    shutil.rmtree(out, ignore_errors=True)
    metrics.unlink(missing_ok=True)
    script = ["-m", "ftrt.examples.hf_trainer", "--out", str(out), "--steps", str(steps), "--save-steps",
              str(save_steps), "--metrics", str(metrics)]
    if system == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script,
               "--no-ftrt"]
    else:
        cmd = [sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--nproc-per-node", "2", *script]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{system} failed: {res.stderr[-2000:]}")
    times = [json.loads(x)["time"] for x in metrics.read_text().splitlines()]
    gaps = [b - a for a, b in zip(times[4:], times[5:])]
    return statistics.median(gaps)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench hf_callback", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--save-steps", default="1,10", help="comma-separated save intervals (default 1,10)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for save in [int(x) for x in args.save_steps.split(",")]:
            rows = {"torchrun": [], "ftrt": []}
            for r in range(args.reps):  # interleaved, the order flipped every repeat
                for system in (("torchrun", "ftrt") if r % 2 == 0 else ("ftrt", "torchrun")):
                    rows[system].append(_run(system, save, args.steps, work))
            ratios = [f / t for f, t in zip(rows["ftrt"], rows["torchrun"])]
            res[f"save_every_{save}"] = {**rows, "ratios": ratios, "median_ratio": statistics.median(ratios)}
            print(f"save every {save} step(s): torchrun {statistics.median(rows['torchrun']) * 1000:.1f} ms/step, "
                  f"ftrt {statistics.median(rows['ftrt']) * 1000:.1f} ms/step; pairs "
                  f"{', '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
