"""The per-step cost of ftrt inside other trainers: each example script under torchrun without ftrt
and under ``ftrt launch`` with ftrt's integration, 2 ranks on gloo, interleaved and repeated.

- ``hf``: ``ftrt/examples/hf_trainer.py`` (a tiny Llama, the Hugging Face ``Trainer``) with
  ``ftrt.integrations.hf.FtrtCallback`` (heartbeats; a committed manifest and fenced pointer for
  every checkpoint);
- ``trl``: ``ftrt/examples/trl_grpo.py`` (TRL's ``GRPOTrainer`` generating with a tiny Llama) with
  ``ftrt.integrations.trl.FtrtCallback`` (the above, plus each rank's generation buffer);
- ``lightning``: ``ftrt/examples/lightning_steps.py`` with ``ftrt.integrations.lightning``'s
  checkpoint IO and callback;
- ``ddp``: ``ftrt/examples/ddp_steps.py`` (the recovery bench's DDP job: a small MLP, each step
  padded with a sleep to ``--ddp-step-time``, as a GPU step leaves the CPU waiting; 0: no padding),
  under ftrt with ``--boundary`` (heartbeats and the round-end agreement), its small resume file
  written by rank 0 in both.

Both systems save alike, every ``--save-steps``, in the trainer's own format; the step time is the
median gap between consecutive logged steps from step 5 on (start-up excluded).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ftrt import progress

@dataclass(frozen=True)
class Example:
    """One example script: its module, the options naming its output, the flags each system adds."""

    module: str
    needs: str
    """The module it needs installed (skipped otherwise)."""
    names: tuple[str, str, str]
    """Its options for the output (a folder, or a file), the save interval and the per-step metrics file."""
    plain: tuple[str, ...] = ()
    """Flags that leave ftrt out (torchrun's runs)."""
    ftrt: tuple[str, ...] = ()
    """Flags only ftrt's runs get."""


EXAMPLES = {
    "hf": Example("ftrt.examples.hf_trainer", "accelerate", ("--out", "--save-steps", "--metrics"), ("--no-ftrt",)),
    "trl": Example("ftrt.examples.trl_grpo", "trl", ("--out", "--save-steps", "--metrics"), ("--ftrt", "none")),
    "lightning": Example("ftrt.examples.lightning_steps", "pytorch_lightning", ("--out", "--save-every", "--metrics"),
                         ("--no-ftrt",)),
    # ftrt's part here is the round-end agreement; its output is one small resume file
    "ddp": Example("ftrt.examples.ddp_steps", "torch", ("--ckpt", "--ckpt-every", "--progress"),
                   ftrt=("--boundary",)),
}


def _script(ex: Example, system: str, out: Path, metrics: Path, steps: int, save_steps: int,
            extra: tuple[str, ...]) -> list[str]:
    """The example's command line (after ``python``) for ``system``."""
    out_flag, save_flag, metrics_flag = ex.names
    return ["-m", ex.module, out_flag, str(out), "--steps", str(steps), save_flag, str(save_steps), metrics_flag,
            str(metrics), *extra, *(ex.plain if system == "torchrun" else ex.ftrt)]


LOGS = Path(__file__).resolve().parent / "results" / "logs"
"""A failed run's whole output is kept here (the bench retries it once)."""


def _run(trainer: str, system: str, save_steps: int, steps: int, work: Path, failures: list[str],
         extra: tuple[str, ...] = ()) -> float:
    out, metrics = work / f"{trainer}-{system}-out", work / f"{trainer}-{system}.jsonl"
    launcher = ["torch.distributed.run"] if system == "torchrun" else ["ftrt.cli.main", "launch"]
    for attempt in range(2):
        shutil.rmtree(out, ignore_errors=True)
        out.unlink(missing_ok=True)  # an example whose output is one file
        metrics.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", *launcher, "--standalone", "--nproc-per-node", "2",
               *_script(EXAMPLES[trainer], system, out, metrics, steps, save_steps, extra)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if res.returncode == 0:
            break
        LOGS.mkdir(parents=True, exist_ok=True)
        log = LOGS / f"trainers-{trainer}-{system}-{time.strftime('%H%M%S')}.log"
        log.write_text(res.stdout + res.stderr)
        failures.append(f"{trainer} under {system} (saves every {save_steps}) exited {res.returncode}; output in {log}")
        print(f"  {failures[-1]}{'; retrying' if attempt == 0 else ''}", flush=True)
    else:
        raise RuntimeError(f"{trainer} under {system} failed twice: {failures[-1]}")
    times = [json.loads(x)["time"] for x in metrics.read_text().splitlines()]
    gaps = [b - a for a, b in zip(times[4:], times[5:])]
    return statistics.median(gaps)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench trainers", description=__doc__.splitlines()[0])
    p.add_argument("--trainer", default="hf,trl,lightning,ddp", help="comma-separated, of hf, trl, lightning, ddp")
    p.add_argument("--ddp-step-time", type=float, default=0.05,
                   help="the ddp job's step, padded with a sleep to this many seconds (default 0.05; 0: no padding)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--save-steps", default="1,10", help="comma-separated save intervals (default 1,10)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    trainers = [t.strip() for t in args.trainer.split(",") if t.strip()]
    unknown = [t for t in trainers if t not in EXAMPLES]
    if unknown:
        p.error(f"--trainer {','.join(unknown)}: give some of {', '.join(EXAMPLES)}")
    res: dict = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for trainer in trainers:
            needs = EXAMPLES[trainer].needs
            if importlib.util.find_spec(needs) is None:
                print(f"{trainer}: skipped ({needs} is not installed)", flush=True)
                continue
            for save in [int(x) for x in args.save_steps.split(",")]:
                rows = {"torchrun": [], "ftrt": []}
                with progress.bar(2 * args.reps, f"{trainer}, save every {save}", "run") as shown:
                    for r in range(args.reps):  # interleaved, the order flipped every repeat
                        for system in (("torchrun", "ftrt") if r % 2 == 0 else ("ftrt", "torchrun")):
                            extra = ("--step-time", str(args.ddp_step_time)) if trainer == "ddp" else ()
                            rows[system].append(_run(trainer, system, save, args.steps, work, failures, extra))
                            shown.update()
                ratios = [f / t for f, t in zip(rows["ftrt"], rows["torchrun"])]
                res.setdefault(trainer, {})[f"save_every_{save}"] = {
                    **rows, "ratios": ratios, "median_ratio": statistics.median(ratios)}
                print(f"{trainer}, save every {save} step(s): torchrun "
                      f"{statistics.median(rows['torchrun']) * 1000:.1f} ms/step, ftrt "
                      f"{statistics.median(rows['ftrt']) * 1000:.1f} ms/step; pairs "
                      f"{', '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f})", flush=True)
    if failures:
        res["failed_runs"] = failures  # retried; each one's whole output is in bench/results/logs
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
