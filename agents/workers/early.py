"""What an agent starts before anything else: its run directory, fence file and first spares.

``ftrt launch`` builds an :class:`EarlyStart` right after parsing its arguments, before it imports
the agent's heavier modules (pydantic, gRPC, ~0.4 s here), so a new node's spares begin importing
torch at once: that import is most of the time a new node needs to join. This module therefore
imports nothing heavy itself.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass, field

from ftrt import _diag, envnames, roundendfile, tmpdirs
from ftrt.agents.workers.fence import FenceWriter
from ftrt.agents.peers.replicator import make_mem_dir
from ftrt.agents.workers.procs import Spawned, spawn_bootstrap
from ftrt.agents.workers.template import spawn_template


@dataclass
class EarlyStart:
    """The agent's run directory, fence file, worker environment and pre-started spares: a spare
    template (:mod:`ftrt.agents.workers.template`) that forks them once warm, or with templates off, the
    spares themselves."""

    run_dir: str
    fence: FenceWriter
    round_end: roundendfile.RoundEndWriter
    base_env: dict[str, str]
    mem_dir: str
    spawned: list[Spawned] = field(default_factory=list)
    template: tuple[Spawned, socket.socket] | None = None

    @classmethod
    def begin(cls, *, nproc: int, warm: bool, warm_imports: tuple[str, ...], spawn: bool = True) -> "EarlyStart":
        run_dir = tmpdirs.owned_dir("ftrt-agent-")  # removed by the next agent here if this one is killed
        fence = FenceWriter(os.path.join(run_dir, "fence"))
        round_end = roundendfile.RoundEndWriter(os.path.join(run_dir, "round_end"))
        mem_dir = make_mem_dir()
        base_env = dict(os.environ)
        base_env[envnames.MEM_DIR] = mem_dir
        base_env[roundendfile.ENV] = round_end.path
        if nproc > 1 and "OMP_NUM_THREADS" not in base_env:
            base_env["OMP_NUM_THREADS"] = "1"  # as torchrun does for several workers per node
        early = cls(run_dir, fence, round_end, base_env, mem_dir)
        if spawn and warm and not _diag.off("template"):
            # One warm-up for the node, not one per worker: the spares are forks of it.
            early.template = spawn_template(base_env=base_env, fence_path=fence.path,
                                            warm_imports=warm_imports, idle=False)
        elif spawn and warm:
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

    def take_template(self) -> tuple[Spawned, socket.socket] | None:
        out, self.template = self.template, None
        return out

    def discard(self) -> None:
        """Undo everything (the launch failed before an agent took over)."""
        tpl = self.take_template()
        if tpl is not None:
            self.spawned.append(tpl[0])
            tpl[1].close()
        for s in self.take_spawned():
            try:
                os.killpg(s.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            s.popen.wait()
            if s.control_fd >= 0:
                os.close(s.control_fd)
            os.close(s.report_fd)
        self.fence.close()
        tmpdirs.remove(self.run_dir)
        tmpdirs.remove(self.mem_dir)
