"""The per-node agent: membership, rounds, workers, fencing, draining. ``ftrt launch`` runs one.

The agent is a state machine (:mod:`.states`, each state an object carrying its data) driven by
one loop, shaped like torch elastic's ``_invoke_run``: each pass first monitors (a stop signal, the
lease, the job's end, a drain asked for, exited or hung workers) and then takes one branch on the
state. Every step is idempotent, so a pass may be triggered by any source (:class:`~.inbox.Inbox`):

- the :class:`~.rendezvous.Rendezvous` view changing (a watch event),
- a worker exiting, a peer found dead, a stop signal,
- and a 0.5 s tick (hang checks, lease checks).

Recovery paths and what bounds their time:

- a peer's process dies: its liveness stream breaks and its port refuses connections; we revoke
  its lease; every agent sees the key vanish; the next round is written after ``settle`` s;
- a local worker fails: the other local workers stop, a restart request is written (fenced by
  the round); the next round follows after ``settle`` s;
- in either case the new round starts from warm spares: no interpreter boot, no torch import.

:func:`~.parts.assemble` builds every part the agent uses; :func:`main` serves the gRPC service
(which sees the agent only as a :class:`~ftrt.agents.peers.service.StatusSource`), runs the agent and
closes the parts in order. A local failure (an exit or a hang) takes one route,
:meth:`Agent._fail_round`, awaited by the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from pathlib import Path

from ftrt.agents.config import LaunchConfig
from ftrt.agents.inbox import StopSignal
from ftrt.agents.parts import AgentParts, assemble, neighbours
from ftrt.agents.peers.monitor import MONITORED_PEERS
from ftrt.agents.ops.probes import judge
from ftrt.agents.peers.service import AgentServicer, AgentStatus, serve
from ftrt.agents.states import (
    AgentState, Drain, Draining, Ended, Fenced, Finished, Running, Starting, State, Waiting, check_transition,
)
from ftrt.agents.workers.boundary import Deferral, boundary_deadline, planned_change
from ftrt.agents.workers.env import pending_env, recorded_error, worker_env
from ftrt.agents.workers import unfixable
from ftrt.agents.workers.hangs import find_hung
from ftrt.agents.workers.keep import is_join, job_runs_in_place, take_round_timeout
from ftrt.agents.workers.warmup import change_interval, idle_warm_grace
from ftrt.checkpoint.cadence import estimate_mtbf
from ftrt.errors import FtrtError, LeaseLost, RoundChanged, StoreError, WorkerFailure
from ftrt.privatefiles import private_dir
from ftrt.roster import LocalRound, NotLoaded
from ftrt.store.api import Store

log = logging.getLogger(__name__)

SPARE_REFILL_DELAY = 0.5
"""Seconds after a round starts before used spares are replaced (at idle CPU priority, so they
only use what the running workers leave; a spare needed before it is warm is boosted)."""


WAIT_NOTICE_FIRST_S = 5.0
"""An agent still waiting for a round this long after it began to wait says what it waits for ..."""
WAIT_NOTICE_EVERY_S = 30.0
"""... and again this often."""


class Agent:
    """One node's agent, with every part built (:func:`~.parts.assemble`). ``await agent.run()`` joins
    the job, drives its rounds and returns the process exit code; :func:`run_agent` does it all."""

    def __init__(self, parts: AgentParts, stop: StopSignal) -> None:
        self.parts = parts
        self.cfg = parts.cfg
        self.log = parts.log
        self.stop = stop
        self.state: State = Starting()
        self._last_started: LocalRound | None = None
        """The last round this node started workers in (None before the first), for the metrics."""
        self._notice: str | None = None
        """A preemption notice (:mod:`.preemption`), once one came."""
        self._background: set[asyncio.Task] = set()
        self._view_loaded = asyncio.Event()
        """Set once the rendezvous read the job (a node joining decides from it how to start)."""
        self._waiting: tuple[float, float] | None = None
        """(since, last said) while it waits for a round that includes it (:meth:`_say_what_it_waits_for`)."""

    def status(self) -> AgentStatus:
        """A snapshot for the gRPC service (:class:`~ftrt.agents.peers.service.StatusSource`)."""
        p = self.parts
        return AgentStatus(
            job_id=self.cfg.job_id, node_id=self.cfg.node_id, round=self.state.seen_round,
            state=self.state.kind.value, current=p.rdzv.view.round, workers=p.pool.running + p.pool.early + p.pool.spares,
            warm_workers=p.pool.warm_count, max_restarts=self.cfg.max_restarts,
        )

    # -- state ----------------------------------------------------------------------------------
    def _become(self, new: State) -> None:
        """Move to ``new`` (checked against the state diagram) and publish it to the parts that
        report it (log prefix, event log, status)."""
        if new.kind is not self.state.kind:
            check_transition(self.state.kind, new.kind)
            self.log.debug("state %s -> %s", self.state.kind.value, new.kind.value)
        self.state = new
        self.parts.node.state, self.parts.node.worker_round = new.kind, new.seen_round

    def _workers_round(self) -> LocalRound | None:
        """The round this node's workers run in now, if they run (:class:`Running`, or
        :class:`Draining` until the round without this node replaces theirs)."""
        return self.state.round if isinstance(self.state, (Running, Draining)) else None

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.log.error("%s failed: %r", task.get_coro().__qualname__, exc, exc_info=exc)

    # -- entry ----------------------------------------------------------------------------------
    async def run(self) -> int:
        self.stop.on_stop(self.parts.inbox.poke)
        if self.cfg.preemption_file or self.cfg.preemption_url:
            from ftrt.agents.ops import preemption

            self._spawn(preemption.watch(self.cfg.preemption_file, self.cfg.preemption_url, self.cfg.preemption_poll,
                                         self._on_notice))
        try:
            await self._join()
            await self.parts.rdzv.start()
            self._view_loaded.set()
            self._become(Waiting())
            self.log.info(
                "joined job %r as %s (agent %s, %d worker(s), etcd %s)",
                self.cfg.job_id, self.cfg.node_id, self.parts.agent_addr, self.cfg.nproc_per_node,
                self.parts.endpoints,
            )
            return await self._loop()
        finally:
            for task in list(self._background):
                task.cancel()

    async def _join(self) -> None:
        """Take a lease and register this node (a new incarnation)."""
        pool = self.parts.pool
        # In place, a node joining a running job may start its workers before it is admitted
        # (_start_early): it says it is ready only once it looked.
        ready = ((not self.cfg.warm_workers) or pool.warm_count >= self.cfg.nproc_per_node) and \
            self.cfg.recovery != "in-place"
        record = await self.parts.membership.join(ready=ready)
        if not record.ready:
            self._spawn(self._announce_ready(record.incarnation))

    async def _announce_ready(self, incarnation: str) -> None:
        pool, membership = self.parts.pool, self.parts.membership
        await pool.spares_ready()
        warm_after = time.monotonic() - pool.spares[0].spawned_at if pool.spares else 0.0
        await self._view_loaded.wait()
        if self.cfg.recovery == "in-place" and not pool.running and not pool.early and await self._joins_in_place():
            try:
                await self._start_early()
            except Exception as exc:  # noqa: BLE001 - any failure: the node still joins, as without an early start
                self.log.error("could not start workers before admission (%r); they start once the node is admitted",
                               exc)
        record = membership.record
        if record is None or record.incarnation != incarnation or record.ready:
            return
        await membership.update(ready=True)
        self.log.info("warm workers ready after %.2f s", warm_after)

    async def _joins_in_place(self) -> bool:
        """Whether this node joins a running job whose workers change rounds in place (another node
        said so in its record), so that its own may start before it is admitted."""
        p = self.parts
        rnd = p.rdzv.view.round
        if rnd is None or not rnd.active or self._included(rnd):
            return False
        try:
            return job_runs_in_place(await p.membership.records(), self.cfg.node_id)
        except StoreError as exc:
            self.log.warning("could not read the job's node records (%s); the workers start once admitted", exc)
            return False

    async def _start_early(self) -> None:
        """Start this node's workers before it is admitted, and wait (at most ``--join-timeout``)
        until each has warmed up to :meth:`ftrt.Runtime.init_process_group`: the running ranks then
        wait only for the new process group, not for a newcomer's start (imports, compilation)."""
        p, n = self.parts, self.cfg.nproc_per_node
        t0 = time.monotonic()
        workers = await p.pool.take(n, store=True)
        for local_rank, worker in enumerate(workers):
            p.pool.start_early(worker, local_rank=local_rank, env=pending_env(**self._job_env(local_rank)),
                               script=self.cfg.script, module=self.cfg.module, argv=self.cfg.script_args)
        self.log.info("the job's workers change rounds in place: started %d worker(s) (pids %s) before this node's "
                      "admission, so that they warm up before the running ranks wait for them",
                      n, [w.pid for w in workers])
        if await p.pool.wait_in_place(workers, self.cfg.join_timeout):
            seconds = time.monotonic() - t0
            self.log.info("workers warmed up before admission in %.2f s", seconds)
            p.events.emit("workers_warmed", f"{self.cfg.node_id}'s {n} worker(s) warmed up before admission in "
                          f"{seconds:.2f} s", seconds=round(seconds, 3))
        else:
            self.log.warning("the workers started before admission did not all reach rt.init_process_group within "
                             "%g s (--join-timeout): the node joins now, and the ones not ready are replaced",
                             self.cfg.join_timeout)

    def _job_env(self, local_rank: int) -> dict:
        """What :func:`~ftrt.agents.workers.env.job_env` needs for this node's worker ``local_rank``."""
        p = self.parts
        return dict(
            node_id=self.cfg.node_id, local_rank=local_rank, local_world_size=self.cfg.nproc_per_node,
            job_id=self.cfg.job_id,
            max_restarts=self.cfg.max_restarts, agent_addr=p.agent_addr, etcd=p.endpoints,
            etcd_access=p.etcd_access, mtbf=self.cfg.mtbf, checkpoint_key_file=self.cfg.checkpoint_key_file,
            nccl_async_error_handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            recovery=self.cfg.recovery, reconfigure_timeout=self.cfg.reconfigure_timeout,
            min_nodes=self.cfg.min_nodes,
        )

    async def _say_in_place(self, workers: list) -> None:
        """Once every worker of this node's round said it changes rounds in place, say so in the
        node's record: a node joining later then starts its workers before it is admitted."""
        p = self.parts
        if await p.pool.wait_in_place(workers, self.cfg.join_timeout):
            await p.membership.update(in_place=True)

    # -- the loop -------------------------------------------------------------------------------
    async def _loop(self) -> int:
        seen = -1
        while True:
            await self.parts.inbox.wait(seen, 0.5)
            seen = self.parts.inbox.version
            await self._update_probes()
            code = await self._pass()
            if code is not None:
                return code

    async def _pass(self) -> int | None:
        """One pass of the loop: monitor, then one branch on the state; the exit code once the
        agent is done, else None."""
        if self.stop.signum is not None:
            self._become(Ended(AgentState.STOPPED, self.state.seen_round))
            return 128 + self.stop.signum
        if not isinstance(self.state, Fenced) and self.parts.membership.expired():
            await self._fence_self()
        if isinstance(self.state, Fenced):
            return await self._fenced(self.state)
        job = self.parts.rdzv.view.job
        if job is not None:
            return await self._finish_job(job.state, job.reason)
        if not isinstance(self.state, Draining) and (why := self._drain_reason()) is not None:
            if isinstance(self.state, Finished):
                self.log.info("draining after this node's workers finished: nothing to hand over; leaving")
                self._become(Ended(AgentState.STOPPED, self.state.seen_round))
                return 0
            await self._begin_drain(why)
        await self._handle_exits()
        self._cut_stuck_teardowns()
        if (hang := self._find_hang()) is not None:
            await self._fail_round("hang", hang)
        match self.state:
            case Finished() as finished:
                return self._after_finishing(finished)
            case Draining():
                await self._reconcile()
                return await self._continue_drain()  # the old round's peers keep its replicas until it left
            case _:
                await self._reconcile()
                self._update_peers()
                self._say_what_it_waits_for()
                return None

    def _say_what_it_waits_for(self, now: float | None = None) -> None:
        """While this node waits for a round that includes it, say so (after
        :data:`WAIT_NOTICE_FIRST_S`, then every :data:`WAIT_NOTICE_EVERY_S`): what the job needs
        to start, and when it gives up; a silent wait looks like a hang."""
        now = time.monotonic() if now is None else now
        if not isinstance(self.state, Waiting) or self._included(self.parts.rdzv.view.round):
            self._waiting = None
            return
        since, said = self._waiting or (now, now - WAIT_NOTICE_EVERY_S + WAIT_NOTICE_FIRST_S)
        self._waiting = (since, said)
        if now - said < WAIT_NOTICE_EVERY_S:
            return
        self._waiting = (since, now)
        view = self.parts.rdzv.view
        known = f"; {len(view.nodes)} registered" if view.nodes else ""
        rnd = view.round
        what = ("the job's first round" if rnd is None else
                f"a round with this node (round {rnd.round} has {sum(g.count for g in rnd.header.groups)} node(s), "
                f"{'running' if rnd.active else 'below the minimum'})")
        self.log.info("waiting %.0f s for %s: job %r runs with %d to %d nodes (--nnodes)%s; below its minimum it "
                      "fails after %g s (--join-timeout)", now - since, what, self.cfg.job_id, self.cfg.min_nodes,
                      self.cfg.max_nodes, known, self.cfg.join_timeout)

    def _after_finishing(self, finished: Finished) -> int | None:
        """This node's workers are done: wait for the others (the job's end), at most the exit
        barrier's timeout."""
        if time.monotonic() > finished.since + self.cfg.exit_barrier_timeout:
            self.log.warning("other members did not finish within %.0f s; exiting", self.cfg.exit_barrier_timeout)
            self._become(Ended(AgentState.SUCCEEDED, finished.seen_round))
            return 0
        return None

    async def _finish_job(self, state: str, reason: str) -> int:
        await self.parts.pool.stop_running(self.cfg.stop_grace)
        if state == "succeeded":
            self._become(Ended(AgentState.SUCCEEDED, self.state.seen_round))
            self.log.info("job succeeded")
            return 0
        self._become(Ended(AgentState.FAILED, self.state.seen_round))
        raise WorkerFailure(f"The job failed: {reason}.")

    # -- fencing --------------------------------------------------------------------------------
    async def _fence_self(self) -> None:
        """The lease may be gone: stop the workers now and stop renewing (:class:`Fenced`)."""
        p = self.parts
        reason = p.membership.lost_reason() or "the lease ran out before it could be renewed"
        self.log.error("lost membership (%s): stopping workers now", reason)
        p.fence.fence()
        p.pool.kill_running_now()
        await p.pool.stop_running(0.0)
        p.membership.orphan()
        self._become(Fenced(reason, self.state.seen_round))
        p.metrics.fault("fenced")
        p.events.emit("fenced", f"{self.cfg.node_id} fenced itself: {reason}", evidence=reason)

    async def _fenced(self, fenced: Fenced) -> int | None:
        """Rejoin as a new member (one try a pass); a node asked to leave meanwhile leaves instead:
        its workers are gone already, so there is nothing to hand over."""
        if (why := self._drain_reason()) is not None:
            self.log.info("asked to leave while fenced (%s): nothing to hand over; leaving", why)
            self._become(Ended(AgentState.STOPPED, fenced.seen_round))
            return 0
        try:
            await self._join()
        except (StoreError, LeaseLost) as exc:
            self.log.warning("rejoining failed (%s); retrying", exc)
            return None
        self._become(Waiting(fenced.seen_round))
        self.log.info("rejoined as a new member")
        return None

    # -- workers' exits and hangs ---------------------------------------------------------------
    async def _handle_exits(self) -> None:
        p = self.parts
        exited = p.inbox.take_exited()
        rnd = self._workers_round()
        if rnd is None:
            return
        failed = [w for w in exited if w.round == rnd.round and w.exit_code != 0 and not w.teardown_cut]
        if failed:
            w = failed[0]
            detail = f"rank {w.rank} (pid {w.pid}) exited with code {w.exit_code}"
            error_file = str(Path(p.mem_dir) / "errors" / f"round-{w.round}" / f"rank-{w.rank}.json")
            started = w.last_heartbeat is not None or w.in_place  # it got going: the error may pass
            if not started and (why := unfixable.read_note(error_file)) is not None:
                await self._fail_round("failure", f"{detail}: {why}", unfixable=True)
                return
            if cause := recorded_error(error_file):
                detail += f": {cause}"
            await self._fail_round("failure", detail)
            return
        workers = p.pool.running
        if workers and all(w.exit_code == 0 or w.teardown_cut for w in workers):
            p.pool.finished()
            self._become(Finished(rnd, time.monotonic()))
            self.log.info("all workers exited 0 in round %d", rnd.round)
            p.events.emit("node_done", f"{self.cfg.node_id} finished in round {rnd.round}")
            await p.membership.update(done_round=rnd.round)

    def _cut_stuck_teardowns(self) -> None:
        """Kill the workers done with their work whose exit is overdue (``--teardown-timeout``)."""
        if self._workers_round() is None:
            return
        p = self.parts
        done = [w for w in p.pool.running if w.done_at is not None and w.exit_code is None and not w.teardown_cut]
        overdue = {rank for rank, _ in find_hung(time.monotonic(), [(w.rank, w.done_at) for w in done],
                                                   self.cfg.teardown_timeout)}
        for w in done:
            if w.rank in overdue:
                self.log.warning("rank %d said its work was done and has not exited %g s later (--teardown-timeout): "
                                 "its teardown is stuck (e.g. a process group's destructor at interpreter exit); "
                                 "killed it, its work counts as finished", w.rank, self.cfg.teardown_timeout)
                p.events.emit("teardown_cut", f"rank {w.rank} killed {self.cfg.teardown_timeout:g} s after it "
                              "said it was done", rank=w.rank)
                p.pool.cut_teardown(w)

    def _find_hang(self) -> str | None:
        """A running worker silent past ``--hang-timeout`` (after its first heartbeat, until it
        said it is done), as the failure's detail; None if none."""
        if self._workers_round() is None:
            return None
        hung = find_hung(
            time.monotonic(),
            [(w.rank, w.last_heartbeat) for w in self.parts.pool.running if w.exit_code is None and w.done_at is None],
            self.cfg.hang_timeout,
        )
        if not hung:
            return None
        rank, silent = hung[0]
        return f"rank {rank} sent no heartbeat for {silent:.1f} s (timeout {self.cfg.hang_timeout:g} s)"

    async def _fail_round(self, kind: str, detail: str, *, unfixable: bool = False) -> None:
        """The one route of a local failure (an exit or a hang): stop the workers and ask for a
        restart of their round, unless another node's request replaced it already. After an exit,
        live workers that change rounds in place (:mod:`~ftrt.agents.workers.keep`) stay and wait
        for the new round; only the failed one is replaced. ``unfixable``: the worker's script
        failed in a way no restart mends (:mod:`~ftrt.agents.workers.unfixable`); the request asks
        the decider to fail the job instead, and every worker stops."""
        rnd = self._workers_round()
        if rnd is None:
            return
        p = self.parts
        failed = rnd.round  # captured: a new round may start while the workers stop
        self._become(Draining(self.state.drain, None, failed) if isinstance(self.state, Draining) else Waiting(failed))
        if unfixable:
            self.log.error("worker %s in round %d: %s; no restart can mend this, so the job fails", kind, failed, detail)
        else:
            self.log.warning("worker %s in round %d: %s; asking for a restart", kind, failed, detail)
        p.metrics.fault(f"worker_{kind}")
        p.events.emit(f"worker_{kind}", detail, round=failed, evidence=detail)
        # After an exit, the live workers wait in place for the restarted round; only the failed one goes.
        keep = kind == "failure" and not unfixable
        if not keep or not await p.pool.keep(recovery=self.cfg.recovery, holds_store=False):
            await p.pool.stop_running(self.cfg.restart_grace)
        current = p.rdzv.view.round
        if self.state.seen_round != failed or current is None or current.round != failed:
            # Another node's report already replaced round `failed` (one hang stalls every rank's
            # heartbeat, so several agents see it): that round restarted these workers too.
            self.log.info("round %d was already replaced; no restart request needed", failed)
            return
        try:
            await p.rdzv.request_restart(failed, "unfixable" if unfixable else kind, detail)
        except StoreError as exc:
            self.log.warning("could not request a restart: %s", exc)

    async def _update_probes(self) -> None:
        p = self.parts
        rnd = p.rdzv.view.round
        try:
            in_round = self._included(rnd) and self.state.seen_round == rnd.round
        except NotLoaded:
            in_round = False
        await p.probes.update(judge(
            self.state.kind, registered=p.membership.record is not None, expired=p.membership.expired(),
            in_round=in_round, current_round=rnd.round if rnd is not None else None))

    # -- draining -------------------------------------------------------------------------------
    def _on_notice(self, why: str) -> None:
        self._notice = why
        self.parts.inbox.poke()

    def _drain_reason(self) -> str | None:
        """Why this node should drain now (SIGTERM, a preemption notice, ``ftrt drain``), or None."""
        if self.stop.drain_asked:
            return "SIGTERM"
        if self._notice is not None:
            return f"preemption notice: {self._notice}"
        req = self.parts.rdzv.jobview.drain
        record = self.parts.membership.record
        if req is not None and record is not None and req.incarnation == record.incarnation:
            return f"ftrt drain{': ' + req.reason if req.reason else ''}"
        return None

    async def _begin_drain(self, why: str) -> None:
        """Leave gracefully: tell the workers, and ask for a round without this node (a planned
        change: every rank ends the round at a step boundary and saves it)."""
        p = self.parts
        now = time.monotonic()
        drain = Drain(why, now, now + self.cfg.drain_timeout, member=self._included(p.rdzv.view.round))
        running = self.state.round if isinstance(self.state, Running) else None
        self._become(Draining(drain, running, self.state.seen_round))
        self.log.warning("draining (%s): asking for a round without this node; leaving within %g s (--drain-timeout)",
                         why, self.cfg.drain_timeout)
        p.events.emit("drain_started", f"{self.cfg.node_id} drains: {why}", reason=why, timeout=self.cfg.drain_timeout)
        p.round_end.drain()
        await p.membership.update(leaving=True)

    def _included(self, rnd: LocalRound | None) -> bool:
        me = rnd.member(self.cfg.node_id) if rnd is not None else None
        record = self.parts.membership.record
        return bool(rnd is not None and rnd.active and me is not None and record is not None
                    and me.incarnation == record.incarnation)

    async def _continue_drain(self) -> int | None:
        """One pass of a drain: the exit code once this node has left, else None (keep going)."""
        assert isinstance(self.state, Draining)
        p, drain = self.parts, self.state.drain
        now = time.monotonic()
        if now >= drain.deadline:
            self.log.warning("the drain did not finish within %g s (--drain-timeout); leaving as a crash would",
                             self.cfg.drain_timeout)
            p.events.emit("drain_timeout", f"{self.cfg.node_id} left without finishing its drain ({drain.reason})",
                          reason=drain.reason)
            self._become(Ended(AgentState.STOPPED, self.state.seen_round))
            return 128 + signal.SIGTERM
        record = p.membership.record
        if record is not None and not record.leaving:
            await p.membership.update(leaving=True)  # the first write failed: etcd was away
        rnd = p.rdzv.view.round
        if self._included(rnd) or p.pool.running:
            return None  # the decider has not written the round without this node yet
        if rnd is not None and not rnd.active and not drain.below_min_said:
            drain.below_min_said = True
            self.log.warning("without this node the job is below its minimum of %d nodes: it waits for a newcomer "
                             "(--join-timeout %g s)", self.cfg.min_nodes, self.cfg.join_timeout)
        kept = await p.replicator.flush(max(0.0, drain.deadline - time.monotonic()))
        if kept is False:
            self.log.warning("a sharded rank's newest memory checkpoint may not have reached a peer before the "
                             "drain's deadline; the job restores it from storage if it must")
        took = time.monotonic() - drain.started
        if drain.member:
            self.log.info("drained in %.2f s (%s); leaving", took, drain.reason)
        else:
            self.log.info("drained in %.2f s (%s): this node was not in the job's current round, so it had nothing "
                          "to hand over; leaving", took, drain.reason)
        p.events.emit("drained", f"{self.cfg.node_id} left the job gracefully ({drain.reason})",
                      reason=drain.reason, seconds=round(took, 3))
        self._become(Ended(AgentState.STOPPED, self.state.seen_round))
        return 0

    # -- rounds ---------------------------------------------------------------------------------
    async def _reconcile(self) -> None:
        """Make this node's workers match the current round."""
        p = self.parts
        rnd = p.rdzv.view.round
        if rnd is None or rnd.round == self.state.seen_round:
            return
        included = self._included(rnd)
        draining = self.state if isinstance(self.state, Draining) else None
        if not included or draining is not None:  # a draining node starts no new workers
            if p.pool.running:
                old = self._workers_round()
                if old is not None:
                    await self._end_at_boundary(old, rnd)
                await p.pool.stop_running(self.cfg.restart_grace)
                self.log.info("round %d %s; workers stopped", rnd.round,
                              f"does not include this node ({rnd.reason})" if not included
                              else "was written before this node's drain was seen")
                p.events.emit("workers_stopped", f"round {rnd.round} does not include {self.cfg.node_id}",
                              round=rnd.round)
            self._become(Draining(draining.drain, None, rnd.round) if draining is not None else Waiting(rnd.round))
            return
        await self._start_round(rnd)

    async def _end_at_boundary(self, old: LocalRound, new: LocalRound) -> None:
        """Before a planned round replaces ``old``, let the workers that poll for it finish their
        step, save it and exit (:mod:`ftrt.agents.workers.boundary`), for at most a few steps."""
        p = self.parts
        polling = [w for w in p.pool.running if w.polls_boundary and w.exit_code is None]
        if not polling or not planned_change(old, new):
            return
        drain_deadline = self.state.drain.deadline if isinstance(self.state, Draining) else math.inf
        t0 = time.monotonic()

        def deferrals() -> list[Deferral]:  # workers that end the round at a later step
            return [w.ends_after for w in polling if w.ends_after is not None and w.ends_after.round == old.round]

        latest = t0

        def deadline() -> float:  # only ever later: a slow step must not cut the wait it was given
            nonlocal latest
            intervals = [w.step_interval for w in polling if w.step_interval is not None]
            latest = max(latest, boundary_deadline(t0, max(intervals) if intervals else None, deferrals()))
            return min(latest, drain_deadline)

        def overtaken() -> str | None:  # why waiting on is no use
            cur = p.rdzv.view.round
            if cur is not None and cur.round > new.round:
                return f"round {cur.round} replaced round {new.round} meanwhile"
            failed = [w for w in polling if w.exit_code not in (None, 0)]
            return f"rank {failed[0].rank} exited with code {failed[0].exit_code}" if failed else None

        p.round_end.request(old.round, durable=not new.active)
        self.log.info("round %d ends at a step boundary: its workers were asked to save their step and stop "
                      "(waiting up to %.1f s)", old.round, max(0.0, deadline() - t0))
        exited, told = False, False
        while not exited and (left := deadline() - time.monotonic()) > 0:
            exited = await p.pool.wait_exited(polling, min(left, 0.5))
            later = max((d.end for d in deferrals()), default=None)
            if later is not None and not told:
                told = True
                more = "" if exited else f": waiting up to {max(0.0, deadline() - time.monotonic()):.1f} s more"
                self.log.info("round %d ends after step %d, where its workers said they would end it (their "
                              "trainer's next boundary a new round can resume from)%s", old.round, later, more)
            if not exited and (why := overtaken()) is not None:
                self.log.warning("round %d: stopped waiting for its workers to end it at a step boundary: %s",
                                 old.round, why)
                break
        if exited:
            self.log.info("round %d ended at a step boundary (step %s) in %.0f ms: its workers saved and stopped",
                          old.round, max(w.step for w in polling), (time.monotonic() - t0) * 1000)
        else:
            self.log.warning("round %d: workers did not stop at a step boundary within %.1f s; stopping them",
                             old.round, time.monotonic() - t0)

    async def _start_round(self, rnd: LocalRound) -> None:
        p = self.parts
        t0 = time.monotonic()
        first = rnd.first == self.cfg.node_id
        kept = await p.pool.keep(recovery=self.cfg.recovery, holds_store=first)
        if not kept and p.pool.running:
            if (old := self._workers_round()) is not None:
                await self._end_at_boundary(old, rnd)
            await p.pool.stop_running(self.cfg.restart_grace)
        missing = [lr for lr in range(self.cfg.nproc_per_node) if lr not in kept]
        fresh = await p.pool.take(len(missing), store=0 in missing)
        if first:
            holder = kept.get(0) or fresh[0]
            if holder in fresh:
                try:
                    await asyncio.wait_for(holder.ready.wait(), self.cfg.worker_start_timeout)
                except asyncio.TimeoutError:
                    await p.pool.discard([holder])
                    p.pool.give_back(fresh)
                    await self._request_restart_unassigned(
                        rnd, f"the worker holding the round's store did not start within "
                             f"{self.cfg.worker_start_timeout:g} s (--worker-start-timeout)")
                    return
                if holder.exit_code is not None:
                    p.pool.give_back(fresh)
                    await self._request_restart_unassigned(rnd, "the worker holding the round's store died")
                    return
            try:
                await p.rdzv.publish_master(rnd, p.host, holder.store_port)
            except RoundChanged:
                p.pool.give_back(fresh)
                return
            except StoreError as exc:  # etcd did not answer: the next pass of the loop tries again
                p.pool.give_back(fresh)
                self.log.warning("could not publish round %d's store address (%s); retrying", rnd.round, exc)
                return
            master_addr, master_port = p.host, holder.store_port
        else:
            master = await self._wait_master(rnd.round)
            if master is None:
                p.pool.give_back(fresh)
                return
            master_addr, master_port = master.addr, master.port
        offset = rnd.rank_offset(self.cfg.node_id)
        previous = self._last_started
        joined = previous.round if (previous is not None and previous.complete and rnd.complete and is_join(
            previous.members, rnd.members, faults_between=rnd.faults - previous.faults)) else None  # may finish a step
        errors = private_dir(Path(p.mem_dir) / "errors" / f"round-{rnd.round}")
        spares = iter(fresh)
        for local_rank in range(self.cfg.nproc_per_node):
            env = worker_env(rnd, master_addr=master_addr, master_port=master_port,
                             error_file=str(errors / f"rank-{offset + local_rank}.json"), **self._job_env(local_rank))
            if local_rank in kept:
                p.pool.hand_round(kept[local_rank], local_rank=local_rank, rank=offset + local_rank,
                                  round_no=rnd.round, env=env, adds_to=joined)
            else:
                p.pool.assign(
                    next(spares), local_rank=local_rank, rank=offset + local_rank, round_no=rnd.round, env=env,
                    script=self.cfg.script, module=self.cfg.module, argv=self.cfg.script_args,
                )
        self._last_started = rnd
        self._become(Running(rnd))
        p.metrics.round_started(rnd.round, rnd.world_size, rnd.node_count, rnd.reason, first=previous is None,
                                fault=previous is not None and rnd.faults > previous.faults, written=rnd.created,
                                mode="in-place" if kept else "restart")
        last = offset + self.cfg.nproc_per_node - 1
        if kept:
            ranks = sorted(offset + lr for lr in kept)
            p.events.emit("workers_reconfigured", f"ranks {ranks} took round {rnd.round} in place, "
                          f"{len(fresh)} started ({rnd.reason})", ranks=ranks,
                          pids=[kept[lr].pid for lr in sorted(kept)], world_size=rnd.world_size)
            self._spawn(self._await_reconfigured(rnd.round, list(kept.values()), join=joined is not None))
        else:
            p.events.emit("workers_started", f"ranks {offset}-{last} of {rnd.world_size} "
                          f"started ({rnd.reason})", ranks=list(range(offset, last + 1)),
                          world_size=rnd.world_size)
        admitted = sum(1 for w in kept.values() if w.since_round == rnd.round)  # started before admission
        how = (f"{len(kept) - admitted} kept in place, " if len(kept) > admitted else "") + \
            (f"{admitted} started before admission, " if admitted else "") + f"{len(fresh)} started:"
        self.log.info(
            "round %d: %s ranks %d-%d of %d (%s) in %.0f ms",
            rnd.round, how if kept else "started",
            offset, last, rnd.world_size, rnd.reason, (time.monotonic() - t0) * 1000,
        )
        if self.cfg.recovery == "in-place" and p.membership.record is not None and not p.membership.record.in_place:
            self._spawn(self._say_in_place(list(p.pool.running)))
        if len(p.pool.spares) < self.cfg.nproc_per_node:  # used now, or by workers started before admission
            age = time.time() - (rnd.job_started or time.time())
            mtbf = estimate_mtbf(self.cfg.mtbf, rnd.faults, age).seconds
            p.pool.refill_later(SPARE_REFILL_DELAY,
                                idle_grace=idle_warm_grace(change_interval(mtbf, rnd.round, age)))

    async def _await_reconfigured(self, round_no: int, kept: list, *, join: bool) -> None:
        """Kill a worker kept in place that has not taken round ``round_no`` in time
        (:func:`~ftrt.agents.workers.keep.take_round_timeout`: longer at a join, which a worker may
        take after its step); its exit then fails the round as any worker's failure would, and the
        round that follows replaces it."""
        timeout = take_round_timeout(self.cfg.reconfigure_timeout, self.cfg.hang_timeout, join=join)
        await self.parts.pool.wait_taken(kept, timeout)
        late = [w for w in kept if w.exit_code is None and w.round == round_no and not w.took_round.is_set()]
        current = self._workers_round()
        if not late or current is None or current.round != round_no:
            return
        for w in late:
            detail = (f"rank {w.rank} (pid {w.pid}) did not take round {round_no} in place within {timeout:g} s "
                      f"(--reconfigure-timeout{', two --hang-timeout steps at a join' if join else ''}); killed it, "
                      "it is replaced")
            self.log.warning("%s", detail)
            self.parts.events.emit("reconfigure_timeout", detail, round=round_no, rank=w.rank)
            w.proc.signal(signal.SIGKILL)

    async def _request_restart_unassigned(self, rnd: LocalRound, detail: str) -> None:
        self._become(Waiting(rnd.round))
        try:
            await self.parts.rdzv.request_restart(rnd.round, "store", detail)
        except StoreError as exc:
            self.log.warning("could not request a restart: %s", exc)

    async def _wait_master(self, rnd: int):
        """Wait for the round's master record, but give up on stop, fencing or a newer round."""
        p = self.parts
        seen = p.inbox.version
        while True:
            rec = p.rdzv.masters.get(rnd)
            if rec is not None:
                return rec
            cur = p.rdzv.view.round
            if (
                cur is None or cur.round != rnd or p.rdzv.view.job is not None
                or self.stop.signum is not None or p.membership.expired()
            ):
                return None
            await p.inbox.wait(seen, 0.5)
            seen = p.inbox.version

    def _update_peers(self) -> None:
        """Monitor this node's ring successors and replicate to the first ``--replicas`` of them;
        keep a channel dialled to the next successor too, the one that takes a lost neighbour's
        place (no handshake on the recovery's path)."""
        p = self.parts
        rnd = p.rdzv.view.round
        used = neighbours(self.cfg)
        try:  # the rendezvous reads the groups of used + 1 successors (see assemble)
            after = rnd.successors(self.cfg.node_id, used + 1) if rnd is not None else []
        except NotLoaded as exc:
            self.log.error("cannot find this node's peers: %s", exc)
            return
        running = isinstance(self.state, Running)
        p.monitor.watch({m.node_id: m.agent_addr for m in after[:MONITORED_PEERS] if running and m.agent_addr})
        p.replicator.set_peers([m.agent_addr for m in after[:self.cfg.replicas] if m.agent_addr])
        addrs = [m.agent_addr for m in after if m.agent_addr]
        p.channels.keep(addrs)
        for addr in addrs[used:]:
            p.channels.dial(addr)


async def main(cfg: LaunchConfig, early=None, store: Store | None = None) -> int:
    """Assemble an agent, serve its gRPC service, run it and close everything it built."""
    loop = asyncio.get_running_loop()
    stop = StopSignal(drain=cfg.drain_timeout > 0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.catch, sig)
    try:
        async with contextlib.AsyncExitStack() as stack:
            parts, server = await assemble(cfg, early=early, store=store, stack=stack)
            if stop.signum is not None:
                return 128 + stop.signum
            if stop.drain_asked:  # SIGTERM while starting: nothing to hand over, do not join
                log.info("asked to drain before joining the job; leaving")
                return 0
            agent = Agent(parts, stop)
            await serve(server, AgentServicer(agent, parts.mem_dir, parts.token, parts.gate))
            return await agent.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_agent(cfg: LaunchConfig, early=None) -> int:
    """Run an agent to completion in a fresh event loop; return the exit code."""
    try:
        return asyncio.run(main(cfg, early))
    except FtrtError:
        raise
    except KeyboardInterrupt:
        return 130
