"""What the elastic group's tests share (Ray's and Monarch's): the regression worker's batches, the
weights one process trains on whole batches, and the ledger check."""

from __future__ import annotations

import torch

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
