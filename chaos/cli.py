"""``ftrt chaos list | run FILE.yaml [--report DIR] [--seed N]``: the chaos suite's command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ftrt.errors import FtrtError


def chaos_main(argv: list[str]) -> int:
    from ftrt.chaos.scenario import builtin, load_scenario

    p = argparse.ArgumentParser(prog="ftrt chaos", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the built-in scenarios with a one-line description")
    run = sub.add_parser("run", help="run scenarios; exit 0 only when every invariant holds")
    run.add_argument("files", nargs="+", help="scenario YAML files (chaos/scenarios/*.yaml are built in)")
    run.add_argument("--report", default="chaos-report", help="report folder (default ./chaos-report; "
                     "one subfolder per scenario when several are given)")
    run.add_argument("--seed", type=int, default=0, help="seeds random targets and the job (default 0)")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for path, sc in builtin():
            print(f"{path.stem:<24} {sc.description}")
        print(f"\n(files in {path.parent}; run one with: ftrt chaos run {path.parent}/NAME.yaml)")
        return 0
    from ftrt.chaos.report import write_report
    from ftrt.chaos.runner import ChaosRun, _lines

    scenarios = [(Path(f), load_scenario(f)) for f in args.files]  # all valid before anything runs
    failed = []
    for path, sc in scenarios:
        out = Path(args.report) if len(scenarios) == 1 else Path(args.report) / path.stem
        report = ChaosRun(sc, out / "work", seed=args.seed).run()
        write_report(report, out, _lines(out / "work" / "run-metrics.jsonl"))
        print(f"[chaos] {sc.name}: {'PASSED' if report.passed else 'FAILED'} (goodput {report.goodput}); "
              f"report in {out}/report.md")
        for name, v in report.invariants.items():
            print(f"    {'ok ' if v['ok'] else 'NO '} {name}: {v['reason']}")
        if not report.passed:
            failed.append(sc.name)
    if failed:
        raise FtrtError(f"Invariants broken in: {', '.join(failed)}.")
    return 0


if __name__ == "__main__":
    sys.exit(chaos_main(sys.argv[1:]))
