"""One worker of an elastic Ray group: ``python -m ftrt.integrations.ray.worker``, run by the node's
ftrt agent (``ftrt launch``, which its node host started), never by hand.

It connects to its node host (:mod:`~ftrt.integrations.ray.host`), builds the group's worker object
(the driver's ``module:Class`` and arguments) *before* its process group, so a joining node's
workers are warm when they are admitted, then joins the round's process group
(:meth:`ftrt.Runtime.init_process_group`: the worker changes rounds in place) and serves calls.

It heartbeats to its agent between calls and after each, so ``--hang-timeout`` judges the methods
only. A round change never restarts it. Between calls it takes a new round within
:data:`IDLE_POLL_S`; in a call, a collective that fails because a peer died, or a round waiting at
the call's start, ends the attempt in :class:`ftrt.WorldChanged`: the worker takes the round and
runs the call again at the new world size. Each time it enters a round, including its first, it
calls the object's ``on_world_change()`` if it has one: the place to agree on the state
(:func:`ftrt.sync_state`) and rebuild what wraps the process group (DDP). A class attribute
``process_group_backend`` ("gloo", "nccl") chooses the backend; by default NCCL where CUDA is. A method may therefore
run again after a world change, and must give the same effect twice: the usual way is an explicit
step argument, and skipping a step the (agreed) state already holds.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import time
import traceback
from multiprocessing.connection import Client, Connection
from typing import Any

from ftrt import envnames
from ftrt.errors import ConfigError, WorldChanged
from ftrt.integrations.ray import wire

IDLE_POLL_S = 0.1
"""How often an idle worker looks for a new round between calls."""
HEARTBEAT_S = 1.0
"""How often an idle worker tells its agent it is alive. A method that runs longer than the agent's
``--hang-timeout`` is taken for a hang: give the group's ``launch_args`` a larger one for long calls."""


def load_target(target: str) -> type:
    """The class ``module:Class`` names (a clear error when it cannot be found)."""
    module_name, sep, name = target.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"The worker class {target!r} is not module:Class (e.g. my_pkg.workers:Trainer).")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(f"The module {module_name} has no {name!r} (from the worker class {target!r}).") from None


class Worker:
    """The serving loop of one worker (see the module docstring)."""

    def __init__(self, rt: Any, conn: Connection, obj: Any) -> None:
        self.rt = rt
        self.conn = conn
        self.obj = obj
        self.calls = 0
        """Calls answered (the heartbeats' step)."""

    def place(self) -> wire.Place:
        return wire.Place(self.rt.round, self.rt.rank, self.rt.world_size)

    def enter_round(self, *, first: bool = False) -> None:
        """Take the waiting round (not on ``first``, the one just joined) and run the object's
        ``on_world_change``, again as long as the world changes under it; then tell the host where
        this worker is now (:class:`~ftrt.integrations.ray.wire.Ready`)."""
        while True:
            try:
                if not first:
                    self.rt.reconfigure()
                first = False
                hook = getattr(self.obj, "on_world_change", None)
                if hook is not None:
                    with self.rt.step():
                        hook()
                break
            except WorldChanged:
                continue
        self.conn.send(wire.Ready(self.rt.local_rank, os.getpid(), self.place()))

    def run(self, call: wire.Call) -> wire.Reply:
        """Run ``call``, again in each new round until it completes or fails on its own."""
        local_rank, pid = self.rt.local_rank, os.getpid()

        def failed(error: str) -> wire.Reply:
            return wire.Reply(call.seq, local_rank, pid, self.place(), False, error=error)

        try:
            args, kwargs = pickle.loads(call.payload)
            method = getattr(self.obj, call.method)
        except Exception:  # noqa: BLE001 - the driver hears why, the worker serves on
            return failed(traceback.format_exc())
        while True:
            try:
                with self.rt.step():
                    value = method(*args, **kwargs)
                break
            except WorldChanged:
                try:
                    self.enter_round()
                except Exception:  # noqa: BLE001 - e.g. the object's state cannot be agreed: the driver hears why
                    return failed(traceback.format_exc())
            except Exception:  # noqa: BLE001 - the driver gets the method's error, the worker serves on
                return failed(traceback.format_exc())
        try:
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - a value that cannot travel fails the call, not the worker
            return failed(f"{call.method} returned a {type(value).__name__}, which cannot be pickled: {exc}")
        return wire.Reply(call.seq, local_rank, pid, self.place(), True, payload)

    def serve(self) -> None:
        beat = 0.0
        while True:
            if time.monotonic() - beat >= HEARTBEAT_S:  # idle is not hung: the driver may be busy
                self.rt.heartbeat(self.calls)
                beat = time.monotonic()
            if self.conn.poll(IDLE_POLL_S):
                try:
                    message = self.conn.recv()
                except EOFError:
                    return  # the host is gone; the agent stops this worker soon
                if isinstance(message, wire.Stop):
                    return
                if isinstance(message, wire.Call):
                    reply = self.run(message)
                    self.calls += 1
                    self.rt.heartbeat(self.calls)
                    beat = time.monotonic()
                    self.conn.send(reply)
            elif self.rt.world_changed():
                self.enter_round()


def main(argv: list[str] | None = None) -> int:
    import ftrt

    path = os.environ.get(envnames.RAY_HOST_SOCKET)
    key = os.environ.get(envnames.RAY_HOST_KEY)
    if not path or not key:
        print("ftrt.integrations.ray.worker runs under an elastic Ray group's node host, which sets "
              f"{envnames.RAY_HOST_SOCKET} and {envnames.RAY_HOST_KEY}; it is not started by hand.", file=sys.stderr)
        return 2
    rt = ftrt.init()
    conn = Client(path, "AF_UNIX", authkey=bytes.fromhex(key))
    conn.send(wire.Hello(rt.local_rank, os.getpid()))
    init = conn.recv()
    args, kwargs = pickle.loads(init.payload)
    cls = load_target(init.target)
    obj = cls(*args, **kwargs)  # before the group: warm when admitted
    # The class may name its collectives' backend (its tensors' device decides); else NCCL where CUDA is.
    backend = getattr(cls, "process_group_backend", None) or ("nccl" if _cuda() else "gloo")
    rt.init_process_group(backend)
    worker = Worker(rt, conn, obj)
    worker.enter_round(first=True)
    worker.serve()
    rt.done()
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
