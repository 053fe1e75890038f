"""``ftrt chaos list | run FILE.yaml... | storm --mtbf S --duration S``: the chaos suite's command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ftrt.helptext import help_summary
from ftrt.errors import ConfigError, FtrtError

STORM_JOB = {"prompts_per_step": 8, "group_size": 4, "model.d_model": 32, "model.n_layers": 1,
             "model.n_heads": 2, "checkpoint.interval": 5}
"""The storm's default job: the built-in scenarios' tiny GRPO (a step takes ~0.1-0.3 s on 2 cores)."""


def chaos_main(argv: list[str]) -> int:
    from ftrt.chaos.scenario import builtin, load_scenario

    p = argparse.ArgumentParser(prog="ftrt chaos", description=help_summary(__doc__))
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the built-in scenarios with a one-line description")
    run = sub.add_parser("run", help="run scenarios; exit 0 only when every invariant holds")
    run.add_argument("files", nargs="+", help="scenario YAML files (chaos/scenarios/*.yaml are built in)")
    storm = sub.add_parser("storm", help="random faults drawn from a seed (reproducible); exit 0 only when "
                           "every invariant holds")
    storm.add_argument("--mtbf", type=float, required=True, help="mean seconds between faults")
    storm.add_argument("--duration", type=float, required=True, help="seconds (after the first step) in which "
                       "faults are drawn")
    storm.add_argument("--kinds", default="kill_worker,kill_node,freeze_worker",
                       help="comma-separated fault kinds to draw from (default kill_worker,kill_node,freeze_worker)")
    storm.add_argument("--down", type=float, default=10.0, help="seconds a killed node stays down or a "
                       "freeze/partition/outage lasts (default 10)")
    storm.add_argument("--nodes", type=int, default=3, help="nodes (default 3)")
    storm.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    storm.add_argument("--steps", type=int, default=None, help="GRPO steps (default: enough for the "
                       "duration at 0.15 s a step, at least 200)")
    storm.add_argument("--netns", action="store_true", help="nodes in their own network namespaces "
                       "(root; needed for partition_node)")
    storm.add_argument("--s3", action="store_true", help="checkpoints on S3 via moto (needed for storage_*)")
    storm.add_argument("--etcd-security", choices=("none", "tls", "tls+auth"), default="tls",
                       help="etcd over TLS with client certificates (the default), and with tls+auth also a user "
                            "and password; none: plaintext, open to anyone who reaches it")
    storm.add_argument("--agent-tls", action="store_true", help="mutual TLS between agents")
    storm.add_argument("--rollout-servers", type=int, default=0, help="rollout servers: the job samples through "
                       "a fleet (needed for kill_rollout, freeze_rollout, add_rollout; default 0)")
    storm.add_argument("--max-recovery", type=float, default=30.0, help="seconds each fault may take (default 30)")
    storm.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="GRPO config overrides "
                       "(python -m ftrt.grpo --help-config)")
    for sp in (run, storm):
        sp.add_argument("--report", default="chaos-report", help="report folder (default ./chaos-report; "
                        "one subfolder per scenario when several are given)")
        sp.add_argument("--seed", type=int, default=0, help="seeds random targets, storms and the job (default 0)")
        sp.add_argument("--recovery", choices=("in-place", "restart"), default=None,
                        help="how the agents recover (ftrt launch --recovery), for every scenario run: in-place "
                             "or restart (default: the scenario's cluster.recovery, in-place unless it says)")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for path, sc in builtin():
            print(f"{path.stem:<24} {sc.description}")
        print(f"\n(files in {path.parent}; run one with: ftrt chaos run {path.parent}/NAME.yaml)")
        return 0
    if args.cmd == "storm":
        scenarios = [(Path("storm"), storm_scenario(args))]
    else:
        scenarios = [(Path(f), load_scenario(f)) for f in args.files]  # all valid before anything runs
    if args.recovery is not None:
        scenarios = [(path, sc.model_copy(update={"cluster": sc.cluster.model_copy(update={"recovery": args.recovery})}))
                     for path, sc in scenarios]
    return run_scenarios(scenarios, Path(args.report), args.seed)


def storm_scenario(args: argparse.Namespace):
    """The scenario ``ftrt chaos storm`` runs, validated like a file."""
    import yaml

    from ftrt.chaos.scenario import validate

    job = dict(STORM_JOB)
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"Job option {item!r} is not KEY=VALUE (e.g. group_size=8).")
        job[key] = yaml.safe_load(value) if value else ""
    steps = args.steps or max(200, int(args.duration / 0.15))
    data = {
        "name": f"storm-seed{args.seed}", "description": f"random faults every {args.mtbf:g} s on average for "
        f"{args.duration:g} s (seed {args.seed})",
        "cluster": {"nodes": args.nodes, "workers_per_node": args.nproc_per_node, "netns": args.netns,
                    "storage": "s3" if args.s3 else "local", "hang_timeout": 5,
                    "etcd_security": args.etcd_security, "agent_tls": args.agent_tls,
                    "rollout_servers": args.rollout_servers},
        "job": {"grpo": job}, "steps": steps,
        "storm": {"mtbf_s": args.mtbf, "duration_s": args.duration, "down_s": args.down,
                  "kinds": [k.strip() for k in args.kinds.split(",") if k.strip()]},
        "expect": {"max_recovery_s": args.max_recovery, "equivalence": "ledger"},
        "timeout_s": max(600.0, args.duration * 4),
    }
    return validate(data, "storm options")


def run_scenarios(scenarios: list, report_dir: Path, seed: int) -> int:
    from ftrt.chaos.report import write_report
    from ftrt.chaos.runner import ChaosRun, _lines

    failed = []
    for path, sc in scenarios:
        out = report_dir if len(scenarios) == 1 else report_dir / path.stem
        report = ChaosRun(sc, out / "work", seed=seed).run()
        write_report(report, out, _lines(out / "work" / "run-metrics.jsonl"))
        if report.skipped:
            print(f"[chaos] {sc.name}: SKIPPED: {report.skipped}")
            continue
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
