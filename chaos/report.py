"""Chaos reports: ``report.json``, ``report.md`` and ``timeline.png`` in the report folder."""

from __future__ import annotations

import json
from pathlib import Path

from ftrt.chaos.runner import Report


def write_report(report: Report, out: Path, metrics: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(report.to_json() + "\n")
    if report.skipped:
        (out / "report.md").write_text(f"# Chaos run: {report.scenario} — SKIPPED\n\n{report.skipped}.\n")
        return
    lines = [
        f"# Chaos run: {report.scenario} — {'PASSED' if report.passed else 'FAILED'}",
        "",
        f"Seed {report.seed}, {report.steps} steps trained, world sizes {' -> '.join(map(str, report.world_sizes))}, "
        f"goodput {report.goodput if report.goodput is not None else 'n/a'} (productive step time / wall time "
        f"from the first step), {report.wall_s} s in all.",
        "",
        "| fault | target | at (s) | at step | spares | recovery (s) | limit (s) | detail |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in report.faults:
        lines.append(f"| {f.kind} | {f.target} | {f.at} | {f.step} | {'warm' if f.spares_warm else 'cold'} | "
                     f"{f.recovery_s} | {f.limit_s if f.limit_s is not None else '-'} | {f.detail} |")
    if report.metrics:
        lines += ["", "| node | agent's ftrt_recovery_seconds (count, mean) | ftrt_restarts_total |", "|---|---|---|"]
        for node, m in sorted(report.metrics.items()):
            mean = f"{m['recovery_sum_s'] / m['recovery_count']:.2f} s" if m["recovery_count"] else "-"
            lines.append(f"| {node} | {m['recovery_count']}, {mean} | {m['restarts'] or '-'} |")
    lines += ["", "| invariant | holds | why |", "|---|---|---|"]
    for name, v in report.invariants.items():
        lines.append(f"| {name} | {'yes' if v['ok'] else '**NO**'} | {v['reason']} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    if metrics:
        from ftrt.plots import chaos_timeline_png

        t0 = metrics[0]["time"] - metrics[0].get("step_s", 0.0)
        done = [f for f in report.faults if not f.detail.startswith("not injected")]
        events = [(t0 + f.at, f"{f.kind} {f.target}") for f in done]
        events += [(t0 + f.ended_at, f"{f.kind} ends") for f in done if f.ended_at is not None]
        events += [(t0 + f.at + f.recovery_s, "recovered") for f in done if f.recovery_s is not None]
        chaos_timeline_png(out / "timeline.png", metrics, events, title=f"chaos: {report.scenario}")


def load(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())
