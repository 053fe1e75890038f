"""PyTorch Lightning under ftrt: committed asynchronous checkpoints, heartbeats, exact resume.

Lightning removed its fault-tolerant training in 2.0 and does not checkpoint random states or a
plain ``DataLoader``'s position. With this module a training script changes in four places::

    from ftrt.data import ElasticSampler
    from ftrt.integrations.lightning import FtrtCallback, FtrtCheckpointIO, model_checkpoint, resume_checkpoint

    loader = DataLoader(data, batch_sampler=ElasticSampler(len(data), 64, rank=rt.rank, world=rt.world_size))
    trainer = Trainer(..., use_distributed_sampler=False, plugins=[FtrtCheckpointIO()],
                      callbacks=[FtrtCallback(), model_checkpoint(out, every_n_train_steps=1)])
    trainer.fit(module, loader, ckpt_path=resume_checkpoint(out))

- **Checkpoints** (:class:`FtrtCheckpointIO`): each checkpoint is a folder ``step-N.ckpt/`` holding
  Lightning's dictionary (``checkpoint.pt``) and ftrt's manifest. A save copies the tensors off the
  training path (to CPU) and returns; a thread writes the file, then commits it: the manifest
  (size and CRC-32 of every file, written last and atomically) and, under ``ftrt launch``, the
  job's ``latest`` pointer in etcd, fenced by the round. One save at most is in flight: the next
  waits for it. Lightning saves on global rank 0 only, and everything the job needs (every rank's
  random states included, see below) is in that one dictionary, so the commit follows rank 0's
  write alone. A load verifies the manifest *before* ``torch.load`` (``weights_only=True`` unless
  the caller asks otherwise): an unverified pickle is never read. (``LightningModule.load_from_checkpoint``
  bypasses the plugin: give it ``step-N.ckpt/checkpoint.pt``, unverified.)
- **Resume**: :func:`resume_checkpoint` is the newest committed ``step-N.ckpt`` whose files all
  match their manifest and that is not newer than ``latest`` (else None), what to pass to
  ``trainer.fit(ckpt_path=...)``. :func:`model_checkpoint` is the ``ModelCheckpoint`` that names
  folders so, and that replaces a stale folder of a redone step rather than saving beside it.
- **Round ends** (a node joins or drains): the ranks agree on it after a step (one tiny
  all-reduce a step), that step is saved and committed (a planned change lets the ending round
  still commit), and the workers leave; the next round resumes from it with nothing redone.
- **Heartbeats and state** (:class:`FtrtCallback`): ``global_step`` is reported to the node's agent
  every batch, and ``done`` once ``fit`` has finished (after the last commit). Every checkpoint
  holds every rank's random states (torch, CUDA when in use, Python, NumPy; gathered to rank 0 as
  one fixed-size tensor a rank, no pickle between processes) and the state of each
  :class:`ftrt.data.ElasticSampler` in the training loaders, advanced once per batch.

Where the position and the random states come back (Lightning 2.6; ``FitLoop.setup_data`` measures
the loader, creates its iterator, and the loop counts batches from the restored ``batch_idx``):

- The sampler's state is loaded in ``on_train_start``: after Lightning measured the loader with a
  fresh sampler (a whole epoch, as its restored batch counters expect) and before the first index is
  drawn (a loader without worker processes draws lazily, at the first batch). Loaded earlier, the
  sampler would report only the epoch's remaining batches and Lightning would end the epoch early;
  a loader with workers draws when its iterator is created, so it is refused (``num_workers=0``).
- Random states: a checkpoint taken mid-epoch restores them at the first ``on_train_batch_start``,
  the point where the run that saved went on. A checkpoint taken at the end of an epoch restores
  them when loaded, before Lightning creates the next epoch's loader iterator, which draws its
  seed from the global torch generator as it did in the run that saved.

So at the same world size a run resumed after a crash logs bit-identical losses, dropout included
(tested, mid-epoch and at an epoch's end), provided the hooks outside the training step draw no
random numbers and the dataset draws none (a validation loop inside ``fit`` is not covered yet). At another world size each ``ElasticSampler`` goes on
at the next global batch, nothing skipped or repeated (tested), but the saved random states belong
to other data shares: every rank is seeded from ``(seed, step, rank)`` instead, with a warning, and
the run is not bit-identical (nor are the gradients' reductions over other shares).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
import struct
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning_utilities.core.apply_func import apply_to_collection

try:  # the unified package first, then the standalone one
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import CheckpointIO
except ImportError:
    from pytorch_lightning import Callback
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.plugins import CheckpointIO

import ftrt
from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.storage import MANIFEST, parse_url
from ftrt.data import ElasticSampler
from ftrt.errors import CheckpointCorrupt, ConfigError
from ftrt.integrations.commits import commit_folder, newest_committed
from ftrt.roundend import RoundEndVote, distributed

log = logging.getLogger(__name__)

DATA_FILE = "checkpoint.pt"
"""Lightning's checkpoint dictionary inside each checkpoint folder."""

_FOLDER = re.compile(r"^step-(\d+)\.ckpt$")
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def _folder(step: int) -> str:
    return f"step-{step}.ckpt"


def resume_checkpoint(dirpath: str) -> str | None:
    """The newest committed ``step-N.ckpt`` folder of ``dirpath`` whose files all match their
    manifest (and, under ``ftrt launch``, that is not newer than the job's ``latest``), or None."""
    return newest_committed(dirpath, _FOLDER, _folder)


def model_checkpoint(dirpath: str, every_n_train_steps: int = 1, keep: int | None = None) -> ModelCheckpoint:
    """A ``ModelCheckpoint`` saving ``dirpath/step-N.ckpt`` every ``every_n_train_steps`` steps and
    keeping the newest ``keep`` (None: all). A step redone after a restart replaces its stale folder
    (no ``-v1`` beside it), as :func:`resume_checkpoint` expects."""
    keeping = {"save_top_k": -1} if keep is None else {"save_top_k": keep, "monitor": "step", "mode": "max"}
    return ModelCheckpoint(dirpath=dirpath, filename="step-{step}", auto_insert_metric_name=False,
                           every_n_train_steps=every_n_train_steps, enable_version_counter=False, **keeping)


def _local_folder(path: Any) -> Path:
    if "://" in str(path):
        raise ConfigError(f"FtrtCheckpointIO writes local (or mounted) folders; {path} is a URL.")
    return Path(path)


def _stage(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _remove(folder: Path) -> None:
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    elif folder.is_dir():
        (folder / MANIFEST).unlink(missing_ok=True)  # uncommitted first: a half-removed folder is never resumed
        shutil.rmtree(folder)


class FtrtCheckpointIO(CheckpointIO):
    """Asynchronous, committed checkpoint folders (module docstring): ``Trainer(plugins=[FtrtCheckpointIO()])``."""

    def __init__(self, runtime: ftrt.Runtime | None = None) -> None:
        self.rt = runtime or ftrt.init()
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: Future | None = None  # the last save; removals queue behind it on the same thread

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` on CPU and write and commit it as the folder ``path`` in the background,
        once the previous save is done (whose failure, if any, is raised here)."""
        if storage_options is not None:
            raise ConfigError(f"FtrtCheckpointIO takes no storage_options (got {storage_options!r}).")
        folder = _local_folder(path)
        self.flush()
        staged = apply_to_collection(checkpoint, torch.Tensor, _stage)
        self._in_flight = self._pool().submit(self._write, staged, folder, int(checkpoint.get("global_step", 0)))

    def _write(self, staged: dict[str, Any], folder: Path, step: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)  # a redone step's stale folder: uncommitted while replaced
        tmp = folder / f"{DATA_FILE}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(staged, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / DATA_FILE)
        commit_folder(str(folder.parent.absolute()), folder.name, step, self.rt.world_size, trainer="lightning")
        log.debug("committed %s (step %d)", folder, step)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's dictionary from the folder ``path``, read only after every file matched the
        manifest (:class:`ftrt.CheckpointCorrupt` otherwise)."""
        self.flush()
        folder = _local_folder(path)
        if not folder.is_dir():
            raise ConfigError(f"{path} is not a checkpoint folder of FtrtCheckpointIO: it reads only folders "
                              "with a manifest (a plain Lightning .ckpt file is never verified, so never loaded).")
        name = folder.name
        try:  # a step-N.ckpt folder must hold step N's manifest; last.ckpt and other names are what they are
            mf.verify_step(parse_url(str(folder.parent.absolute())), name,
                           name_of=_folder if _FOLDER.match(name) else (lambda _step: name))
        except CheckpointCorrupt as exc:
            raise CheckpointCorrupt(f"Not loading {path}: {exc}") from exc
        return torch.load(folder / DATA_FILE, map_location=map_location,
                          weights_only=True if weights_only is None else weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the folder ``path`` in the background, after the save in flight."""
        self._pool().submit(_remove, _local_folder(path))

    def flush(self) -> None:
        """Wait for the save in flight; raise its failure."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            pending.result()

    def teardown(self) -> None:
        """Flush, then stop the thread."""
        try:
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:  # made on first use: Lightning may tear down and fit again
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrt-ckpt")
        return self._executor


# -- random states as one fixed-size tensor a rank ------------------------------------------------------
def _rng_row() -> torch.Tensor:
    """This process's random states (torch CPU, CUDA when initialised, Python, NumPy) as uint8."""
    cpu = torch.get_rng_state().numpy().tobytes()
    cuda = torch.cuda.get_rng_state().numpy().tobytes() if torch.cuda.is_initialized() else b""
    _, py, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    blob = b"".join([struct.pack("<II", len(cpu), len(cuda)), cpu, cuda, np.asarray(py, np.uint32).tobytes(),
                     struct.pack("<?d", gauss is not None, gauss or 0.0), np.asarray(keys, np.uint32).tobytes(),
                     struct.pack("<iid", pos, has_gauss, cached)])
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _set_rng(row: torch.Tensor) -> None:
    """Restore the states :func:`_rng_row` encoded."""
    blob = row.numpy().tobytes()
    n_cpu, n_cuda = struct.unpack_from("<II", blob)
    at = 8
    torch.set_rng_state(torch.frombuffer(bytearray(blob[at:at + n_cpu]), dtype=torch.uint8))
    at += n_cpu
    if n_cuda:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(blob[at:at + n_cuda]), dtype=torch.uint8))
    at += n_cuda
    py = tuple(int(x) for x in np.frombuffer(blob, np.uint32, 625, at))
    has, gauss = struct.unpack_from("<?d", blob, at + 2500)
    random.setstate((3, py, gauss if has else None))
    at += 2500 + 9
    keys = np.frombuffer(blob, np.uint32, 624, at).copy()
    pos, has_gauss, cached = struct.unpack_from("<iid", blob, at + 2496)
    np.random.set_state(("MT19937", keys, pos, has_gauss, cached))


def _seed_rng(seed: int, step: int, rank: int) -> None:
    value = int.from_bytes(hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()[:4], "little")
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


def _gather(row: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's ``row`` (all the same size), stacked in rank order on every rank."""
    dist = distributed()
    if dist is None or dist.get_world_size() == 1:
        return row[None]
    mine = row.to(device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows).cpu()


def _loaders(iterables: Any) -> list[Any]:
    """The loaders of ``trainer.train_dataloader`` (one, or a list or dict of them, nested)."""
    if isinstance(iterables, dict):
        iterables = list(iterables.values())
    if isinstance(iterables, (list, tuple)):
        return [leaf for item in iterables for leaf in _loaders(item)]
    return [iterables]


class FtrtCallback(Callback):
    """Heartbeats, every rank's random states and the data position in every checkpoint, and their
    restore (module docstring). ``seed`` seeds the ranks after a world-size change."""

    def __init__(self, runtime: ftrt.Runtime | None = None, seed: int = 0) -> None:
        self.rt = runtime or ftrt.init()
        self.seed = seed
        self._trainer = None
        self._samplers: list[ElasticSampler] = []
        self._saved_samplers: list[dict[str, Any]] | None = None  # from the checkpoint, for on_train_start
        self._rng_at_batch: torch.Tensor | int | None = None  # a row or a seed, for the first batch
        self._epoch_end = False  # the last batch trained ended its epoch
        self._ending = False  # ftrt asked to end the round: save this step and leave at the next batch
        self._round_ends = RoundEndVote(self.rt)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer  # rank, world and device for state_dict / load_state_dict
        io = trainer.strategy.checkpoint_io
        for cb in trainer.checkpoint_callbacks if isinstance(io, FtrtCheckpointIO) else []:
            if getattr(cb, "_enable_version_counter", False):
                raise ConfigError(f"ModelCheckpoint(dirpath={cb.dirpath!r}) has enable_version_counter=True: a step "
                                  "redone after a restart would be saved beside its stale folder as -v1. Use "
                                  "ftrt.integrations.lightning.model_checkpoint(...) or enable_version_counter=False.")

    def on_train_start(self, trainer, pl_module) -> None:
        loaders = _loaders(trainer.train_dataloader)
        found = [(dl, dl.batch_sampler) for dl in loaders
                 if isinstance(dl, torch.utils.data.DataLoader) and isinstance(dl.batch_sampler, ElasticSampler)]
        for loader, sampler in found:
            if loader.num_workers > 0:
                raise ConfigError(f"The training DataLoader has num_workers={loader.num_workers}: its workers draw "
                                  "ElasticSampler's first batches when Lightning creates the iterator, before "
                                  "FtrtCallback can restore the data position. Use num_workers=0.")
            if (sampler.rank, sampler.world) != (trainer.global_rank, trainer.world_size):
                raise ConfigError(f"ElasticSampler has rank {sampler.rank} of {sampler.world}, the Trainer "
                                  f"{trainer.global_rank} of {trainer.world_size}: build it with the Trainer's.")
        self._samplers = [sampler for _, sampler in found]
        if len(found) == len(loaders):
            # Lightning knows only its own resumable loaders; this callback restores the position.
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
        elif trainer.global_rank == 0:
            log.warning("A training loader has no ElasticSampler: after a restart mid-epoch Lightning trains that "
                        "epoch again from its first batch.")
        if self._saved_samplers is not None:
            if len(self._saved_samplers) != len(self._samplers):
                raise ConfigError(f"The checkpoint holds {len(self._saved_samplers)} ElasticSampler states, the "
                                  f"training loaders have {len(self._samplers)} ElasticSamplers.")
            for sampler, state in zip(self._samplers, self._saved_samplers):
                sampler.load_state_dict(state)
            self._saved_samplers = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._ending:
            self._end_round(trainer)
        if self._rng_at_batch is not None:
            self._restore_rng(self._rng_at_batch, trainer.global_step, trainer.global_rank)
            self._rng_at_batch = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        for sampler in self._samplers:
            sampler.advance()
        self._epoch_end = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        self.rt.heartbeat(trainer.global_step)
        last = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        self._ending = not last and self._round_ends()

    def _end_round(self, trainer) -> None:
        """A planned change (a node joins or drains): this step is saved, after ``ModelCheckpoint``
        had its turn (it runs after this callback), committed, and every worker leaves; the next
        round resumes from it with nothing redone. Without ftrt's checkpoint IO nothing is saved
        here and the agent stops the workers after its boundary timeout, as before."""
        io, cb = trainer.strategy.checkpoint_io, trainer.checkpoint_callback
        if not isinstance(io, FtrtCheckpointIO) or cb is None or cb.dirpath is None:
            self._ending = False
            return
        step = trainer.global_step
        if getattr(cb, "_last_global_step_saved", -1) != step:
            trainer.save_checkpoint(os.path.join(cb.dirpath, _folder(step)))
        io.flush()  # committed before anyone leaves
        trainer.strategy.barrier("ftrt-round-end")
        self.rt.exit_for_round()

    def on_train_end(self, trainer, pl_module) -> None:
        self._round_ends.close()
        io = trainer.strategy.checkpoint_io
        if isinstance(io, FtrtCheckpointIO):
            io.flush()  # the last checkpoint is committed before the agent hears that this worker is done
        self.rt.done()

    def state_dict(self) -> dict[str, Any]:
        """Every rank's random states (a collective: Lightning dumps a checkpoint on every rank) and
        the samplers' positions."""
        trainer = self._trainer
        return {"rng": _gather(_rng_row(), trainer.strategy.root_device), "world_size": trainer.world_size,
                "step": trainer.global_step, "epoch_end": self._epoch_end,
                "samplers": [sampler.state_dict() for sampler in self._samplers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._trainer
        rank, world = trainer.global_rank, trainer.world_size
        self._saved_samplers = list(state_dict["samplers"])
        if state_dict["world_size"] == world:
            rng = state_dict["rng"][rank]
        else:
            rng = self.seed
            if rank == 0:
                log.warning("Resuming step %d, saved by %d ranks, on %d: ElasticSampler goes on at the next global "
                            "batch (nothing skipped or repeated), but each rank's random states are seeded from "
                            "(seed %d, step, rank) rather than restored, and the gradients are reduced over other "
                            "shares: the run is not bit-identical to one without the change.",
                            state_dict["step"], state_dict["world_size"], world, self.seed)
        if state_dict["epoch_end"]:
            self._restore_rng(rng, state_dict["step"], rank)  # before the next epoch's loader iterator draws
        else:
            self._rng_at_batch = rng

    def _restore_rng(self, rng: torch.Tensor | int, step: int, rank: int) -> None:
        if isinstance(rng, torch.Tensor):
            _set_rng(rng)
        else:
            _seed_rng(rng, step, rank)

