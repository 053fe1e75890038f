"""PNG timelines (matplotlib, headless): reward and world size over time, with events marked.

Used by ``ftrt demo`` and the docs' learning curves; the chaos reports reuse it.
"""

from __future__ import annotations

from pathlib import Path


def event_color(label: str) -> str:
    """Red for a loss (killed, lost), green for a return (restarted, rejoined, added), grey otherwise."""
    low = label.lower()
    if any(w in low for w in ("killed", "lost", "fault")):
        return "tab:red"
    if any(w in low for w in ("restarted", "rejoined", "added", "joined")):
        return "tab:green"
    return "tab:gray"


def label_rows(xs: list[float], span: float, width: float = 0.14) -> list[int]:
    """A row for each event label at ``xs`` (in order) so that none overlaps another: a label
    takes the lowest row whose last label lies more than ``width`` of ``span`` to its left."""
    last: list[float] = []  # per row, the x of its last label
    rows = []
    for x in xs:
        row = next((r for r, at in enumerate(last) if x - at > width * span), len(last))
        if row == len(last):
            last.append(x)
        else:
            last[row] = x
        rows.append(row)
    return rows


def timeline_png(path: str | Path, lines: list[dict], events: list[tuple[float, str]] = (),
                 title: str = "ftrt GRPO run") -> Path:
    """Plot ``reward_mean`` and ``world_size`` of metrics lines against wall time since the first.

    ``events`` are ``(unix time, label)`` pairs drawn as vertical lines (faults, rejoins).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    lines = sorted(lines, key=lambda x: x["time"])
    t0 = min([x["time"] for x in lines] + [t for t, _ in events]) if (lines or events) else 0.0
    t = [x["time"] - t0 for x in lines]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5), height_ratios=[3, 1])
    ax1.plot(t, [x["reward_mean"] for x in lines], lw=1.2, color="tab:blue", label="mean reward per step")
    ax1.set_ylabel("reward")
    ax1.set_ylim(0, 1.02)
    ax1.grid(alpha=0.3)
    ax2.step(t, [x["world_size"] for x in lines], where="post", color="tab:green")
    ax2.set_ylabel("world size")
    ax2.set_xlabel("seconds")
    ax2.set_yticks(sorted({x["world_size"] for x in lines}) or [1])
    ax2.grid(alpha=0.3)
    span = max([*t, *(w - t0 for w, _ in events), 1.0])
    for (when, label), row in zip(events, label_rows([w - t0 for w, _ in events], span)):
        color = event_color(label)
        for ax in (ax1, ax2):
            ax.axvline(when - t0, color=color, ls="--", lw=1)
        ax1.annotate(label, (when - t0, 0.97 - 0.1 * row), xytext=(3, 0), textcoords="offset points", va="top",
                     ha="left", fontsize=8, color=color, bbox={"boxstyle": "round,pad=0.15", "fc": "white",
                                                                "ec": "none", "alpha": 0.8})
    ax1.set_title(title)
    ax1.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curve_png(path: str | Path, lines: list[dict], title: str) -> Path:
    """Reward against step (the docs' learning curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [x["step"] for x in lines]
    rewards = [x["reward_mean"] for x in lines]
    window = 10
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
              for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, rewards, lw=0.8, alpha=0.4, color="tab:blue", label="mean reward per step")
    ax.plot(steps, smooth, lw=1.8, color="tab:blue", label=f"{window}-step mean")
    ax.axhline(0.9, color="gray", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def chaos_timeline_png(path: str | Path, lines: list[dict], events: list[tuple[float, str]], title: str) -> Path:
    """Steps over time per node, which node trained when, world size; faults, their ends and recoveries marked.

    ``lines`` are rank 0's GRPO metrics lines; each names the nodes that trained the step
    (``nodes``; older lines without it count as rank 0's alone). Events labelled ``... ends`` draw
    grey, ``recovered`` green, faults red.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = sorted(lines, key=lambda x: x["time"])
    t0 = min([x["time"] - x.get("step_s", 0.0) for x in lines] + [t for t, _ in events])
    t = [x["time"] - t0 for x in lines]
    nodes = sorted({n for x in lines for n in x.get("nodes", ["rank 0"])})
    fig, (ax1, ax3, ax2) = plt.subplots(3, 1, sharex=True, figsize=(9, 6.5), height_ratios=[3, 1.2, 1])
    colors = plt.get_cmap("tab10")
    for k, node in enumerate(nodes):
        mine = [(ti, x["step"]) for ti, x in zip(t, lines) if node in x.get("nodes", ["rank 0"])]
        # nodes train the same steps together: a small offset keeps every node's line visible
        ax1.plot([a for a, _ in mine], [b + 0.01 * k * max(1, lines[-1]["step"]) for _, b in mine], ".", ms=2.5,
                 color=colors(k % 10), label=node)
        ax3.scatter([a for a, _ in mine], [k] * len(mine), s=3, marker="|", color=colors(k % 10))
    ax1.set_ylabel("step")
    ax1.grid(alpha=0.3)
    ax3.set_yticks(range(len(nodes)), nodes, fontsize=8)
    ax3.set_ylim(-0.7, len(nodes) - 0.3)
    ax3.set_ylabel("training")
    ax3.grid(alpha=0.3, axis="x")
    ax2.step(t, [x["world_size"] for x in lines], where="post", color="tab:green")
    ax2.set_ylabel("world size")
    ax2.set_xlabel("seconds since the first step started")
    ax2.set_yticks(sorted({x["world_size"] for x in lines}))
    ax2.grid(alpha=0.3)
    top = max(x["step"] for x in lines)
    for when, label in events:
        color = "tab:gray" if label.endswith("ends") else "tab:green" if label == "recovered" else "tab:red"
        for ax in (ax1, ax3, ax2):
            ax.axvline(when - t0, color=color, ls=":" if label == "recovered" else "--", lw=1)
        if label != "recovered":
            ax1.annotate(label, (when - t0, top), rotation=90, va="top", ha="right", fontsize=8, color=color)
    ax1.set_title(title)
    ax1.legend(loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
