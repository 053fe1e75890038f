"""A PyTorch Lightning job under ftrt: ``ftrt launch --nproc-per-node 2 -m ftrt.examples.lightning_steps``.

A tiny MLP with dropout classifies fixed synthetic points (made here, nothing downloaded). Each
optimizer step trains one global batch of ``GLOBAL_BATCH`` samples drawn by
:class:`ftrt.data.ElasticSampler` and split over the ranks; the loss is summed over a rank's share
and divided by the global batch (times the world size, which DDP's gradient averaging divides
out), so a step's gradient is the mean over the global batch at every world size. The script adds
ftrt's four pieces to a plain Lightning script: the sampler, ``FtrtCheckpointIO``, ``FtrtCallback``
and ``ckpt_path=resume_checkpoint(out)``; ``--no-ftrt`` is the plain script (Lightning's own
checkpoints and ``DistributedSampler``, no resume), the baseline of a per-step cost benchmark.

Rank 0 appends ``{"step", "loss", "world", "time"}`` to ``--metrics`` every optimizer step (the loss
of the whole global batch); every rank appends the sample ids it trained, ``{"step", "rank",
"world", "round", "ids"}``, to ``--ledger``. Runs alone, under torchrun or under ``ftrt launch``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from torch.nn import functional as F

import ftrt
from ftrt.data import ElasticSampler

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

SAMPLES, FEATURES, CLASSES, GLOBAL_BATCH = 64, 16, 4, 8  # 8 steps an epoch


class Points(torch.utils.data.Dataset):
    """``n`` fixed points with labels from a fixed random linear map; an item is ``(x, y, id)``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = (self.x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Classifier(pl.LightningModule):
    def __init__(self, metrics: str | None, ledger: str | None, step_time: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, CLASSES))
        self.metrics, self.ledger, self.step_time = metrics, ledger, step_time
        self._share_loss = torch.zeros(())

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        total = F.cross_entropy(self.net(x), y, reduction="sum")
        self._share_loss = total.detach()
        return total * self.trainer.world_size / GLOBAL_BATCH

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        loss = self._share_loss.clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)
        step, world = self.trainer.global_step, self.trainer.world_size
        if self.metrics and self.trainer.global_rank == 0:
            with open(self.metrics, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item() / GLOBAL_BATCH, "world": world,
                                    "time": time.time()}) + "\n")
        if self.ledger:
            with open(self.ledger, "a") as f:
                f.write(json.dumps({"step": step, "rank": self.trainer.global_rank, "world": world,
                                    "round": ftrt.init().round, "ids": batch[2].tolist()}) + "\n")
        time.sleep(self.step_time)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the checkpoint folder")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=1, help="a checkpoint every this many steps")
    p.add_argument("--metrics", default=None, help="rank 0 appends one JSON line per optimizer step here")
    p.add_argument("--ledger", default=None, help="every rank appends the sample ids of each step here")
    p.add_argument("--step-time", type=float, default=0.0, help="sleep this long after each step (seconds)")
    p.add_argument("--no-ftrt", action="store_true", help="the plain Lightning script, without ftrt")
    args = p.parse_args(argv)

    rt = ftrt.init()  # rank and world from the launcher's environment (a world of one alone)
    launched = "WORLD_SIZE" in os.environ
    pl.seed_everything(0, verbose=False)
    model = Classifier(args.metrics, args.ledger, args.step_time)
    data = Points(SAMPLES)
    common = dict(accelerator="cpu", devices=rt.local_world_size, num_nodes=rt.world_size // rt.local_world_size,
                  strategy="ddp" if launched else "auto", max_steps=args.steps, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    if args.no_ftrt:
        loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // rt.world_size, shuffle=True,
                                             drop_last=True)
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=args.out, filename="step-{step}", auto_insert_metric_name=False,
                                            every_n_train_steps=args.save_every, save_top_k=-1)
        pl.Trainer(**common, callbacks=[ckpt]).fit(model, loader)
        return

    from ftrt.integrations.lightning import FtrtCallback, FtrtCheckpointIO, model_checkpoint, resume_checkpoint

    sampler = ElasticSampler(SAMPLES, GLOBAL_BATCH, rank=rt.rank, world=rt.world_size, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    trainer = pl.Trainer(**common, use_distributed_sampler=False, plugins=[FtrtCheckpointIO()],
                         callbacks=[FtrtCallback(), model_checkpoint(args.out, every_n_train_steps=args.save_every)])
    trainer.fit(model, loader, ckpt_path=resume_checkpoint(args.out))


if __name__ == "__main__":
    main()
