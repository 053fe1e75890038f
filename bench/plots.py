"""PNG figures for docs/benchmarks.md, drawn from the benchmarks' JSON results."""

from __future__ import annotations

from pathlib import Path

COLORS = {"ftrt": "tab:blue", "ftrt-inplace": "tab:cyan", "torchrun": "tab:orange", "torchft": "tab:purple",
          "c10d best": "tab:orange", "c10d default": "tab:gray"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def goodput_png(rows: list[dict], path: str | Path) -> None:
    """Steps that stand and world size over time, per system, with the kills and rejoins marked."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=[3, 1])
    for r in rows:
        t = [p[0] for p in r["timeline"]]
        color = COLORS.get(r["system"])
        ax1.plot(t, [p[1] for p in r["timeline"]], color=color, lw=1.4,
                 label=f"{r['system']}: goodput {r['goodput']:.1%}, {r['steps']} steps")
        ax2.step(t, [p[2] for p in r["timeline"]], where="post", color=color, lw=1.2)
    for i, f in enumerate(rows[0]["faults"] if rows else []):
        for ax in (ax1, ax2):
            ax.axvline(f["killed_at"], color="tab:red", ls=":", lw=1, label="node killed" if i == 0 and ax is ax1 else None)
            if "restarted_at" in f:
                ax.axvline(f["restarted_at"], color="tab:green", ls=":", lw=1,
                           label="node restarted" if i == 0 and ax is ax1 else None)
    ax1.set_ylabel("step (kept)")
    ax1.legend(loc="upper left", fontsize=8)
    every = rows[0].get("every", 60.0) if rows else 60.0
    ax1.set_title("GRPO, no fault: steps over time" if every is None else
                  f"GRPO, a node killed every {every:g} s: steps that stand over time")
    ax2.set_ylabel("world size")
    ax2.set_xlabel("seconds since the first step")
    ax2.set_yticks(sorted({p[2] for r in rows for p in r["timeline"]}) or [0])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def steps_vs_interval_png(entries: list[dict], path: str | Path) -> None:
    """Steps trained per minute by each system against the interval between node faults."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = ["none" if e["every"] is None else f"{e['every']:g} s" for e in entries]
    x = range(len(entries))
    top = 0.0
    systems = list(dict.fromkeys(k[:-len("_steps")] for e in entries for k in e if k.endswith("_steps")))
    width = 0.8 / max(len(systems), 1)
    for n, system in enumerate(systems):
        dx = (n - (len(systems) - 1) / 2) * width
        rate = [e.get(f"{system}_steps", 0) * 60 / e["wall_s"] for e in entries]
        top = max(top, *rate)
        bars = ax.bar([i + dx for i in x], rate, width=width, color=COLORS.get(system), label=system)
        for b, e in zip(bars, entries):
            ax.annotate(f"{e.get(f'{system}_steps', 0)}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("a node killed every (and back 10 s later)")
    ax.set_ylabel("steps trained per minute")
    ax.set_title("GRPO on 3 nodes: steps trained in the same wall time (labels: steps)")
    ax.set_ylim(0, top * 1.25)  # room for the legend above the bars, clear of the ratio labels
    ax.legend(loc="upper center", ncol=max(len(systems), 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rdzv_scale_png(result: dict, path: str | Path) -> None:
    """Left: rendezvous time against node count, per system and phase (log-log; missing: did not
    finish). Right: ftrt's etcd traffic per round (bytes sent, watch events) against node count."""
    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in result["results"]:
        for phase in ("join", "loss", "decider_loss"):
            if (v := r.get(f"{phase}_s")) is not None:
                series.setdefault((r["system"], phase.replace("_", " ")), []).append((r["nodes"], v))
    for (system, phase), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ls={"join": "-", "loss": "--"}.get(phase, ":"),
                color=COLORS.get(system), label=f"{system} {phase}")
    sizes = sorted({r["nodes"] for r in result["results"]})
    ax.axhline(2.0, color="tab:red", lw=0.8, ls=":", label="target: 2 s")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(sizes, [str(n) for n in sizes])
        a.minorticks_off()
        a.set_yscale("log")
        a.set_xlabel("simulated nodes")
    ax.set_ylabel("seconds to the agreed round")
    ax.set_title("Rendezvous at scale (one local etcd / one TCPStore, 2 cores);\n"
                 "a missing point: no agreement within the cap", fontsize=10)
    ax.legend(fontsize=8)
    ftrt = sorted((r for r in result["results"] if r["system"] == "ftrt"), key=lambda r: r["nodes"])
    for phase, ls in (("join", "-"), ("loss", "--")):
        pts = [(r["nodes"], r[f"{phase}_etcd"]) for r in ftrt if r.get(f"{phase}_etcd")]
        if not pts or "bytes_sent" not in pts[0][1]:
            continue
        n = [p[0] for p in pts]
        ax2.plot(n, [p[1]["bytes_sent"] for p in pts], marker="o", ls=ls, color="tab:blue", label=f"{phase}: bytes sent")
        ax2.plot(n, [max(1, p[1]["watch_events"]) for p in pts], marker="s", ls=ls, color="tab:green",
                 label=f"{phase}: watch events")
    ax2.set_ylabel("per round")
    ax2.set_title("ftrt: etcd traffic per round (from etcd's /metrics)", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """``python -m bench.plots {rdzv_scale,goodput,series} RESULT.json OUT.png``: redraw a figure from a
    result (``series``: steps trained against the fault interval, from ``bench goodput --every A,B``)."""
    import json
    import sys

    kinds = {"rdzv_scale": lambda d, out: rdzv_scale_png(d, out), "goodput": lambda d, out: goodput_png(d["rows"], out),
             "series": lambda d, out: steps_vs_interval_png(d["series"], out)}
    if len(argv) != 3 or argv[0] not in kinds:
        print(f"usage: python -m bench.plots {{{','.join(kinds)}}} RESULT.json OUT.png", file=sys.stderr)
        return 2
    kinds[argv[0]](json.loads(Path(argv[1]).read_text()), argv[2])
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
