"""``ftrt rollout serve``: one rollout server of a job.

Its life: read the job's token and wait for the trainer's policy spec in etcd; build the engine;
serve ``ftrt.v1.RolloutService`` on a port; register ``/ftrt/<job>/rollout/servers/<id>`` under
a lease (address, engine, the weight version it holds) and keep it alive. Pushes and generation
need the job's token, and a push is applied only if the trainer claimed its version and digest
in etcd (:mod:`ftrt.rollout.claims`). When the lease is lost (etcd unreachable, the process frozen past the TTL)
the server **fences** itself: it answers no Generate until it has registered again under a fresh
lease, so a trainer that gave up on it never gets a late answer from it for new work.

A server samples only with weight versions it holds (the built-in engine up to 10, vLLM one): a
request for another is refused (FAILED_PRECONDITION) and the trainer routes it elsewhere. A server
serves the policy spec it started with; when the trainer publishes another (a new run under the
same job id), it exits and says so: restart it for the new run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import grpc.aio

from ftrt import _diag
from ftrt.auth import JobToken, job_token, require_token
from ftrt.store.concurrency import Session
from ftrt.errors import ConfigError, StoreError, StoreUnavailable
from ftrt.jobkeys import JobKeys, check_id
from ftrt.rollout import claims
from ftrt.rollout.engine import BuiltinEngine
from ftrt.rollout.records import ServerRecord
from ftrt.policy.spec import PolicySpec, decode_spec
from ftrt.rollout.errors import EngineFailed, StaleVersion
from ftrt.rollout.weights import Assembler, PushRefused
from ftrt.store import access as etcd_access
from ftrt.store.api import Store
from ftrt.store.etcd import EtcdStore, unreachable
from ftrt.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger("ftrt.rollout")

MAX_MESSAGE = 8 << 20
SPEC_CHECK_S = 2.0
"""How often a server checks that the trainer still publishes the spec it serves."""


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers for one server: generation with the version it holds, pushes from token holders."""

    def __init__(self, server_id: str, job_id: str, engine: BuiltinEngine, token: JobToken,
                 on_version, claimed: Callable[[int, str], Awaitable[str | None]]) -> None:
        self.server_id = server_id
        self.job_id = job_id
        self.engine = engine
        self.token = token
        self.on_version = on_version
        self.claimed = claimed
        """Why a pushed (version, digest) is not one the trainer claims, or None (:mod:`ftrt.rollout.claims`)."""
        self.fenced = True  # until registered
        self.served = 0
        self.generating_since = 0.0
        """When the group being sampled now began (monotonic; 0: idle)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrt-generate")
        self._push_lock = asyncio.Lock()

    async def _authorize(self, context, call: str) -> None:
        await require_token(self.token, context, "This call needs the job's token, which it did not show; only "
                            "the job's trainer holds it.", call=call)

    async def Generate(self, request, context):
        await self._authorize(context, "Generate")
        if self.fenced:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"Rollout server {self.server_id} lost its lease and serves nothing until it has "
                                "registered again.")
        held = self.engine.lookup(request.version, request.weights_digest)
        if held is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"Rollout server {self.server_id} holds weight versions "
                                f"{sorted(self.engine.versions)}, not {request.version} ({request.weights_digest[:12]}); "
                                "push it first.")
        if request.step < 0 or request.prompt_id < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "step and prompt_id must be >= 0.")
        group = {"step": request.step, "prompt_id": request.prompt_id}
        # Diagnostic marks (FTRT_DIAG_TRACE): a group is held from its first mark until its second,
        # which is written before any answer leaves, so a frozen server whose trace shows a group
        # without its answer surely holds it (tests kill servers then, never at a guessed moment).
        _diag.mark("rollout.generate", **group)
        try:
            return await self._generate_reply(held, request, context)
        finally:
            _diag.mark("rollout.answer", **group)

    async def _generate_reply(self, held, request, context) -> rollout_pb2.GenerateReply:
        t0 = time.perf_counter()
        try:
            out = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._generate, held, request.step, request.prompt_id, context.time_remaining())
        except StaleVersion as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"Rollout server {self.server_id}: {exc}.")
        except EngineFailed as exc:
            log.error("the engine failed a group: %s", exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"Rollout server {self.server_id}'s engine failed: {exc}")
        if out is None:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "The group's deadline passed while it waited.")
        self.served += 1
        return rollout_pb2.GenerateReply(
            step=request.step, prompt_id=request.prompt_id, version=held.version, group=out.shape[0],
            width=out.shape[1], tokens=out.numpy().astype("<i4").tobytes(),
            server_id=self.server_id, generate_s=time.perf_counter() - t0)

    def _generate(self, held, step: int, prompt_id: int, remaining: float | None):
        """On the generation thread: sample the group, unless its caller gave up while it queued."""
        if remaining is not None and remaining <= 0:
            return None
        self.generating_since = time.monotonic()
        try:
            return self.engine.generate(held, step, prompt_id)
        finally:
            self.generating_since = 0.0

    async def PushWeights(self, request_iterator, context):
        await self._authorize(context, "PushWeights")
        async with self._push_lock:  # one push at a time; a second waits
            asm = Assembler(self.engine.expected)
            t0 = time.perf_counter()
            try:
                async for msg in request_iterator:
                    asm.feed(msg)
                tensors = asm.result()
            except PushRefused as exc:
                log.warning("weight push refused (versions held still %s): %s", sorted(self.engine.versions), exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            why = await self.claimed(asm.version, asm.digest)
            if why is not None:
                log.warning("weight push of version %d (%s) refused, not the trainer's (versions held still %s): %s",
                            asm.version, asm.digest[:12], sorted(self.engine.versions), why)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"Rollout server {self.server_id} refused version {asm.version}: {why}.")
            try:
                apply_s = await asyncio.get_running_loop().run_in_executor(
                    None, self.engine.apply, asm.version, asm.digest, tensors, asm.keep_from)
            except (PushRefused, EngineFailed) as exc:
                log.warning("weight push not applied (versions held still %s): %s", sorted(self.engine.versions), exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            log.info("now serving weight version %d (%s; %.1f MB in %.3f s, applied in %.3f s)", asm.version,
                     asm.digest[:12], asm.received / 1e6, time.perf_counter() - t0, apply_s)
            await self.on_version()
            return rollout_pb2.PushReply(version=asm.version, digest=asm.digest, bytes=asm.received,
                                         apply_s=apply_s, held=sorted(self.engine.versions))

    async def Info(self, request, context):
        newest = self.engine.newest
        return rollout_pb2.InfoReply(server_id=self.server_id, job_id=self.job_id, engine=self.engine.name,
                                     version=newest.version, digest=newest.digest, served=self.served,
                                     fenced=self.fenced, held=sorted(self.engine.versions),
                                     generating_s=time.monotonic() - since if (since := self.generating_since) else 0.0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def wait_for_spec(store: Store, keys: JobKeys, *, poll: float = 0.5) -> PolicySpec:
    """The policy spec the trainer published, waiting for it (with a line every 30 s)."""
    said = 0.0
    while True:
        kv, _ = await store.get(keys.rollout_spec)
        if kv is not None:
            return decode_spec(kv.value, keys.rollout_spec)
        if time.monotonic() - said > 30:
            log.info("waiting for the trainer of job %s to publish its policy spec at %s", keys.job_id,
                     keys.rollout_spec)
            said = time.monotonic()
        await asyncio.sleep(poll)


class Registration:
    """The server's record in etcd under a lease, kept alive and renewed after a loss."""

    def __init__(self, store: Store, keys: JobKeys, servicer: RolloutServicer, addr: str, ttl: float) -> None:
        self.store = store
        self.keys = keys
        self.servicer = servicer
        self.addr = addr
        self.ttl = ttl
        self.session: Session | None = None
        self.spec_changed = False
        self._spec_check_at = 0.0

    def record(self) -> ServerRecord:
        engine = self.servicer.engine
        return ServerRecord(server_id=self.servicer.server_id, addr=self.addr, engine=engine.name,
                            versions=engine.versions, pid=os.getpid(), max_versions=engine.max_versions,
                            spec_digest=engine.spec.digest)

    async def publish(self) -> None:
        """Write the record (its version changed); a lost lease is the keep-alive's to handle."""
        s = self.session
        if s is None or s.expired():
            return
        try:
            await self.store.put(self.keys.rollout_server(self.servicer.server_id), self.record().encode(),
                                 lease=s.lease_id, timeout=5.0)
        except StoreError as exc:
            log.warning("could not update this server's record: %s", exc)

    async def run(self) -> None:
        """Register, serve until the lease is lost, fence, register again; forever."""
        while True:
            try:
                self.session = await Session(self.store, self.ttl).start()
                await self.store.put(self.keys.rollout_server(self.servicer.server_id), self.record().encode(),
                                     lease=self.session.lease_id, timeout=5.0)
            except StoreError as exc:
                log.warning("cannot register with etcd (%s); trying again in 1 s", exc)
                await asyncio.sleep(1.0)
                continue
            self.servicer.fenced = False
            log.info("registered as %s at %s (lease %#x, %g s TTL)", self.servicer.server_id, self.addr,
                     self.session.lease_id, self.session.granted_ttl)
            fence = asyncio.create_task(self._fence_on_expiry(self.session))
            await self.session.lost.wait()
            fence.cancel()
            if not self.servicer.engine.alive():
                raise EngineFailed("the engine's process exited; this rollout server stops (see its log).")
            if self.spec_changed:
                raise ConfigError(f"The trainer of job {self.keys.job_id} now publishes another policy spec (a "
                                  "new run under this job id); this server served the old one and stops: start it "
                                  "again to serve the new run.")
            self.servicer.fenced = True
            log.warning("lease lost (%s): fenced, serving nothing until registered again", self.session.lost_reason)

    async def _fence_on_expiry(self, session: Session) -> None:
        """Fence at the local lease deadline even if the keep-alive has not noticed yet; leave
        (revoke the lease) when the engine's process died."""
        while not session.lost.is_set():
            if session.expired():
                self.servicer.fenced = True
            if not self.servicer.engine.alive():
                self.servicer.fenced = True
                await session.close()
                return
            if time.monotonic() >= self._spec_check_at:
                self._spec_check_at = time.monotonic() + SPEC_CHECK_S
                if await self._spec_changed():
                    self.servicer.fenced = True
                    self.spec_changed = True
                    await session.close()
                    return
            await asyncio.sleep(0.05)

    async def _spec_changed(self) -> bool:
        try:
            kv, _ = await self.store.get(self.keys.rollout_spec, timeout=2.0)
        except StoreError:
            return False
        return kv is not None and decode_spec(kv.value, self.keys.rollout_spec).digest != self.servicer.engine.spec.digest

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


async def _serve(ns: argparse.Namespace, store: Store, keys: JobKeys, server_id: str, engine, token: JobToken) -> None:
    """Serve ``engine`` on a port and keep this server registered until stopped."""
    registration: Registration
    servicer = RolloutServicer(server_id, ns.job_id, engine, token, on_version=lambda: registration.publish(),
                               claimed=lambda version, digest: claims.check(store, keys, version, digest))
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                      ("grpc.max_send_message_length", MAX_MESSAGE)])
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    try:
        port = server.add_insecure_port(f"{ns.host}:{ns.port}")
        if not port:
            raise ConfigError(f"Cannot serve on {ns.host}:{ns.port}; is the port taken?")
        await server.start()
        registration = Registration(store, keys, servicer, f"{ns.host}:{port}", ns.lease_ttl)
        print(f"ftrt rollout: serving job {ns.job_id} as {server_id} at {ns.host}:{port}", flush=True)
        try:
            await registration.run()
        finally:
            servicer.fenced = True
            await registration.close()
    finally:
        await server.stop(0.5)
        servicer.close()


def check_model_path(spec: PolicySpec, model_dirs: list[str]) -> None:
    """A spec from etcd names the model a server loads: only a folder under one of ``--model-dir``,
    and only safetensors weights (never a pickle)."""
    if not spec.model.hf_path:
        return
    path = Path(spec.model.hf_path).resolve()
    roots = [Path(d).resolve() for d in model_dirs]
    if not any(path == r or r in path.parents for r in roots):
        raise ConfigError(f"The trainer's spec asks for model.hf_path = {spec.model.hf_path!r}, which is under no "
                          "--model-dir of this server; start it with --model-dir naming the folder that holds "
                          "the job's models.")
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise ConfigError(f"model.hf_path {spec.model.hf_path!r} holds no *.safetensors weights here; a rollout "
                          "server loads only safetensors (never pickled .bin/.pt files).")


def check_engine_args(ns: argparse.Namespace) -> None:
    """Refuse engine flags that cannot work, at once: they are used only once the trainer's spec
    arrives."""
    vllm_flags = [f for f, v in (("--vllm-python", ns.vllm_python), ("--vllm-url", ns.vllm_url),
                                 ("--vllm-dir", ns.vllm_dir)) if v]
    if ns.engine == "vllm" and bool(ns.vllm_python) == bool(ns.vllm_url):
        raise ConfigError("--engine vllm needs exactly one of --vllm-url (a running vLLM server) and --vllm-python "
                          "(an interpreter with vLLM, to start one); got "
                          + (" and ".join(vllm_flags) if vllm_flags else "neither") + ".")
    if ns.engine == "builtin" and vllm_flags:
        raise ConfigError(f"{', '.join(vllm_flags)} {'is' if len(vllm_flags) == 1 else 'are'} for --engine vllm; "
                          "this server runs the builtin engine (add --engine vllm, or drop them).")


def build_engine(ns: argparse.Namespace, spec: PolicySpec):
    """The engine ``--engine`` names, for ``spec``."""
    check_model_path(spec, ns.model_dir)
    if ns.engine == "builtin":
        return BuiltinEngine(spec)
    from ftrt import tmpdirs
    from ftrt.rollout.vllm_engine import VllmEngine

    if ns.vllm_dir:
        return VllmEngine(spec, url=ns.vllm_url, python=ns.vllm_python, workdir=Path(ns.vllm_dir),
                          timeout=ns.vllm_timeout, ready_timeout=ns.vllm_ready_timeout)
    # Pushed weights go to a temporary folder: the engine removes it at close, and the next server
    # started here removes it if this one is killed.
    workdir = tmpdirs.owned_dir("ftrt-vllm-")
    try:
        return VllmEngine(spec, url=ns.vllm_url, python=ns.vllm_python, workdir=Path(workdir),
                          timeout=ns.vllm_timeout, ready_timeout=ns.vllm_ready_timeout, remove_workdir=True)
    except BaseException:
        tmpdirs.remove(workdir)
        raise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftrt rollout serve", description="Serve rollouts for one job's trainer "
                                "(rollout.mode=fleet); see docs/rollout.md.")
    p.add_argument("--etcd", required=True, metavar="HOST:PORT[,...]", help="the job's etcd endpoints")
    p.add_argument("--job-id", required=True, help="the job to serve")
    p.add_argument("--server-id", default=None, help="this server's name in the job (default: HOST-PID)")
    p.add_argument("--engine", choices=["builtin", "vllm"], default="builtin",
                   help="builtin: the GRPO policy with counter-seeded sampling (bit-exact); vllm: the job's "
                   "Hugging Face policy (model.hf_path) in a vLLM server (exactly once, not bitwise)")
    p.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                   help="a folder whose Hugging Face models (model.hf_path) this server may load (repeatable; "
                   "the trainer's spec comes from etcd, so a path outside these is refused)")
    p.add_argument("--vllm-python", default=None, metavar="PYTHON", help="vllm: start vLLM's OpenAI server "
                   "with this interpreter (it may live in another virtual environment)")
    p.add_argument("--vllm-url", default=None, metavar="URL", help="vllm: a running vLLM OpenAI server started "
                   "with VLLM_SERVER_DEV_MODE=1 (for reload_weights), instead of --vllm-python")
    p.add_argument("--vllm-dir", default=None, metavar="DIR", help="vllm: where pushed weights are written "
                   "(default: a temporary folder)")
    p.add_argument("--vllm-timeout", type=float, default=60.0, help="vllm: seconds for each HTTP call (default 60)")
    p.add_argument("--vllm-ready-timeout", type=float, default=600.0,
                   help="vllm: seconds vLLM may take to start (default 600)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on and to register (default loopback)")
    p.add_argument("--port", type=int, default=0, help="port to serve on (default: a free one)")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="seconds of etcd lease; the server fences "
                   "itself when it cannot renew within them (default 5)")
    etcd_access.add_arguments(p)
    return p


async def serve(ns: argparse.Namespace) -> None:
    check_id("job id", ns.job_id)
    server_id = check_id("rollout server id", ns.server_id or f"{socket.gethostname()}-{os.getpid()}")
    if not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port {ns.port} is not a port; give 0-65535 (0: a free one).")
    if ns.lease_ttl < 1:
        raise ConfigError(f"--lease-ttl {ns.lease_ttl} is below etcd's 1 s granularity; give at least 1.")
    check_engine_args(ns)  # before waiting for the trainer, which may take long
    access = etcd_access.from_args(ns)
    store = EtcdStore(ns.etcd, access=access)
    keys = JobKeys(ns.job_id)
    try:
        try:
            token = await job_token(store, keys)
        except StoreUnavailable as exc:
            raise unreachable(ns.etcd, 5.0) from exc
        spec = await wait_for_spec(store, keys)
        engine = build_engine(ns, spec)
        try:
            log.info("policy of job %s built (%s engine, spec %s)", ns.job_id, engine.name, spec.digest)
            await _serve(ns, store, keys, server_id, engine, token)
        finally:
            engine.close()
    finally:
        await store.close()


def serve_main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    asyncio.run(serve(ns))
    return 0


def rollout_main(argv: list[str]) -> int:
    """``ftrt rollout SUBCOMMAND``: today ``serve``."""
    p = argparse.ArgumentParser(prog="ftrt rollout", description="Rollout servers for a job's trainer "
                                "(rollout.mode=fleet); see docs/rollout.md.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("serve", help="serve rollouts for one job's trainer: ftrt rollout serve --etcd HOST:PORT "
                   "--job-id ID (ftrt rollout serve --help for every flag)", add_help=False)
    ns, rest = p.parse_known_args(argv[:1])
    return serve_main(rest + argv[1:])
