"""What an agent starts before anything else: its run directory, fence file and first spares.

``ftrt launch`` builds an :class:`EarlyStart` right after parsing its arguments, before it imports
the agent's heavier modules (pydantic, gRPC, ~0.4 s here), so a new node's spares begin importing
torch at once: that import is most of the time a new node needs to join. This module therefore
imports nothing heavy itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field

from ftrt.agents import boundary
from ftrt.agents.fence import FenceWriter
from ftrt.agents.replicator import make_mem_dir
from ftrt.agents.workers import Spawned, spawn_bootstrap


@dataclass
class EarlyStart:
    """The agent's run directory, fence file, worker environment and pre-started spares."""

    run_dir: str
    fence: FenceWriter
    round_end: boundary.RoundEndWriter
    base_env: dict[str, str]
    mem_dir: str
    spawned: list[Spawned] = field(default_factory=list)

    @classmethod
    def begin(cls, *, nproc: int, warm: bool, warm_imports: tuple[str, ...], spawn: bool = True) -> "EarlyStart":
        run_dir = tempfile.mkdtemp(prefix="ftrt-agent-")
        fence = FenceWriter(os.path.join(run_dir, "fence"))
        round_end = boundary.RoundEndWriter(os.path.join(run_dir, "round_end"))
        mem_dir = make_mem_dir()
        base_env = dict(os.environ)
        base_env["FTRT_MEM_DIR"] = mem_dir
        base_env[boundary.ENV] = round_end.path
        if nproc > 1 and "OMP_NUM_THREADS" not in base_env:
            base_env["OMP_NUM_THREADS"] = "1"  # as torchrun does for several workers per node
        early = cls(run_dir, fence, round_end, base_env, mem_dir)
        if spawn and warm:
            for i in range(nproc):
                early.spawned.append(spawn_bootstrap(
                    base_env=base_env, fence_path=fence.path, warm_imports=warm_imports,
                    hosts_store=i == 0, idle=False,
                ))
        return early

    @classmethod
    def for_config(cls, cfg, spawn: bool = False) -> "EarlyStart":
        return cls.begin(nproc=cfg.nproc_per_node, warm=cfg.warm_workers, warm_imports=cfg.warm_imports, spawn=spawn)

    def take_spawned(self) -> list[Spawned]:
        out, self.spawned = self.spawned, []
        return out

    def discard(self) -> None:
        """Undo everything (the launch failed before an agent took over)."""
        for s in self.take_spawned():
            try:
                os.killpg(s.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            s.popen.wait()
            os.close(s.control_fd)
            os.close(s.report_fd)
        self.fence.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.mem_dir, ignore_errors=True)
