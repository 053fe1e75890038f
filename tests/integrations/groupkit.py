"""What the elastic group's tests share (Ray's and Monarch's): the regression worker's batches, the
weights one process trains on whole batches, and the ledger check."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ftrt.chaos.local import wait_until
from ftrt.procs import alive

from ftrt.examples.ray_regression import DIM, sample

BATCH = 12
WORKER = "ftrt.examples.ray_regression:Regression"


def batch(step: int) -> list[int]:
    return list(range(step * BATCH, (step + 1) * BATCH))


def reference_weights(steps: int, lr: float = 0.05) -> torch.Tensor:
    """The weights after ``steps`` steps trained in one process on whole batches."""
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = sample(batch(step))
        opt.zero_grad()
        (((model(x) - y) ** 2).sum() / BATCH).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_ledger(results: list, steps: int) -> None:
    """Each step applied once, and its samples trained once each, by the round that completed it."""
    for step, res in zip(range(steps), results):
        assert not res.missing, f"step {step}: replies of ranks {res.missing} lost"
        trained = [v for v in res.values if not v["skipped"]]
        assert trained and {v["step"] for v in trained} == {step}
        ids = sorted(i for v in trained for i in v["ids"])
        assert ids == batch(step), f"step {step}: trained {ids}"
        assert {v["world"] for v in trained} == {res.world_size} and len(trained) == res.world_size


def pids(group) -> dict[str, int]:
    """Each node's worker pid (one worker per node)."""
    return {st["node_id"]: w["pid"] for st in group.status() for w in st["workers"]}


def lose_a_node_mid_step(group: Any, tmp: Path, lose: Callable[[str], None]) -> tuple[list, dict[str, int], str]:
    """Train steps 0-2, then step 3 with every rank held inside it (its data taken, its all-reduce not
    begun); ``lose(victim)`` takes a node away meanwhile, and the step goes on once the victim's
    worker is gone (it must not take part). Returns the results of steps 0-3, the pids before, and
    the victim's node id."""
    before = pids(group)
    results = [group.call("train", s, batch(s)) for s in range(3)]
    hold = tmp / "hold"
    hold.mkdir()
    got: dict = {}

    def step3() -> None:
        try:
            got["res"] = group.call("train", 3, batch(3), hold=str(hold))
        except Exception as exc:  # noqa: BLE001 - reported below
            got["error"] = exc

    t = threading.Thread(target=step3)
    t.start()
    wait_until(lambda: len(list(hold.glob("started-*"))) == len(before), 120, "every rank inside step 3")
    victim = sorted(before)[0]
    lose(victim)
    wait_until(lambda: not alive(before[victim]), 60, "the lost node's worker gone")
    (hold / "go").touch()
    t.join(300)
    assert not t.is_alive(), "step 3 did not return"
    assert "error" not in got, got.get("error")
    return [*results, got["res"]], before, victim


def train_until_joined(group: Any, results: list, world: int, what: str, timeout: float = 180) -> None:
    """Train the next steps until one runs at ``world`` (a newcomer's workers warm up, then are
    admitted at a step's start; it never came back: fail with ``what``), then two more."""
    step, give_up = len(results), time.monotonic() + timeout
    while results[-1].world_size < world:
        assert time.monotonic() < give_up, what
        results.append(group.call("train", step, batch(step)))
        step += 1
    results += [group.call("train", s, batch(s)) for s in range(step, step + 2)]


def check_after_mid_step_loss(group: Any, results: list, before: dict[str, int], victim: str) -> list[float]:
    """After :func:`lose_a_node_mid_step`: step 3 ran at world 2, two more steps follow, every sample
    was trained once, the survivors kept their processes; returns rank 0's weights."""
    assert results[-1].world_size == 2
    results += [group.call("train", s, batch(s)) for s in range(4, 6)]
    check_ledger(results, 6)
    assert pids(group) == {n: p for n, p in before.items() if n != victim}
    return group.call("weights").values[0]
