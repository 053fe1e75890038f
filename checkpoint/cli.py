"""``ftrt ckpt ls|inspect|verify URL [STEP]``: look at and check checkpoints without a job.

``verify`` exits non-zero naming the bad step and file; ``ls`` marks folders without a valid
manifest as not committed (restore ignores them). With ``--checkpoint-key-file`` (or
``$FTRT_CHECKPOINT_KEY``), only checkpoints signed under the job's key count, as at restore. With
``--etcd EP --job-id J`` (and the ``--etcd-*`` access flags of a secured etcd), the job's
``latest`` pointer is read too: ``ls`` marks it, steps above it are not trusted (as at restore),
and ``verify``/``inspect`` default to the newest committed step at or below it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from ftrt.helptext import help_summary
from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.signing import load_key
from ftrt.checkpoint.storage import is_storage_error, list_steps, parse_url, step_dir, storage_problem
from ftrt.errors import CheckpointCorrupt, ConfigError, FtrtError
from ftrt.store import access as etcd_access


def _storage_options(text: str | None) -> dict:
    if not text:
        return {}
    try:
        opts = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--storage-options is not JSON ({exc}); e.g. '{{\"anon\": true}}'.") from None
    if not isinstance(opts, dict):
        raise ConfigError("--storage-options must be a JSON object.")
    return opts


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ckpt_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ftrt ckpt", description=help_summary(__doc__))
    p.add_argument("action", choices=("ls", "inspect", "verify"))
    p.add_argument("url", help="checkpoint URL (path, file://, s3://bucket/prefix)")
    p.add_argument("step", nargs="?", type=int, help="step (default: the newest committed)")
    p.add_argument("--storage-options", default=None, help="fsspec options as JSON")
    p.add_argument("--checkpoint-key-file", "--key-file", dest="key_file", default=None, metavar="FILE",
                   help="the job's checkpoint key (also $FTRT_CHECKPOINT_KEY): only checkpoints signed under it "
                        "count as committed and verify")
    p.add_argument("--etcd", default=None, metavar="HOST:PORT[,...]", help="the job's etcd, to read its latest pointer")
    p.add_argument("--job-id", default=None, help="the job whose latest pointer to read (with --etcd)")
    etcd_access.add_arguments(p.add_argument_group("etcd security (TLS and auth)"))
    args = p.parse_args(argv)
    key = load_key(args.key_file)
    loc = parse_url(args.url, _storage_options(args.storage_options))
    latest = _pointer(args) if args.etcd else None
    try:
        return _act(args, loc, key, latest)
    except Exception as exc:
        if isinstance(exc, FtrtError) or not is_storage_error(exc):
            raise
        raise storage_problem(args.url, exc) from None


def _act(args: argparse.Namespace, loc, key, latest: int | None) -> int:
    steps = list_steps(loc)
    if args.action == "ls":
        if not steps:
            if loc.is_local and not os.path.isdir(loc.root):
                raise ConfigError(f"There is no folder {loc.root} (from {args.url}): nothing to list. Check the path.")
            print(f"no checkpoints under {args.url}")
            return 0
        for s in steps:
            try:
                m = mf.read_manifest(loc, step_dir(s), key)
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.time))
                signed = "signed" if m.signature else "unsigned"
                mark = "" if not args.etcd else ("  <- the job's latest" if s == latest else
                                                 "  (above the job's latest: not trusted)" if latest is None or
                                                 s > latest else "")
                print(f"step {s:>10}  committed  {when}  world {m.world_size:>3}  {_human(m.total_bytes):>10}  "
                      f"{len(m.files)} files  {m.checksum} {signed}{mark}")
            except CheckpointCorrupt as exc:
                print(f"step {s:>10}  NOT COMMITTED  ({exc})")
        return 0
    step = args.step
    passed_over: list[tuple[int, str]] = []  # newer steps a restore would skip, with why
    if step is None:
        trusted = [s for s in steps if not args.etcd or (latest is not None and s <= latest)]
        for s in reversed(trusted):
            why = _not_committed(loc, s, key)
            if why is None:
                step = s
                break
            passed_over.append((s, why))
        if step is None:
            raise CheckpointCorrupt(f"No committed checkpoint under {args.url}"
                                    + (f": step {passed_over[0][0]}, the newest, {passed_over[0][1]}" if passed_over
                                       else "") + ".")
    if step not in steps:
        raise ConfigError(f"There is no checkpoint step {step} under {args.url} (steps: {steps or 'none'}).")
    if args.action == "inspect":
        m = mf.read_manifest(loc, step_dir(step), key)
        body = json.loads(m.to_json())
        body["total_bytes"] = m.total_bytes
        print(json.dumps(body, indent=2))
        return 0
    t0 = time.monotonic()
    m = mf.verify_step(loc, step_dir(step), key)
    signed = f", signature valid under {key.where}" if key is not None else (
        ", signed (no key given to check it)" if m.signature else ", unsigned")
    print(f"step {step}: {len(m.files)} files, {_human(m.total_bytes)}, all sizes and {m.checksum} sums match"
          f"{signed} ({time.monotonic() - t0:.2f} s)")
    if passed_over:
        newer = "; ".join(f"step {s} {why}" for s, why in passed_over)
        raise CheckpointCorrupt(f"Newer checkpoints under {args.url} are not committed, so a restore skips them and "
                                f"takes step {step}: {newer}. (A save still being written is not committed yet: "
                                "verify again once it is done.)")
    return 0


def _pointer(args: argparse.Namespace) -> int | None:
    """The step the job's ``latest`` pointer in etcd names (None: nothing committed in the job)."""
    from ftrt.checkpoint.pointer import LatestPointer
    from ftrt.jobkeys import check_id
    from ftrt.store.access import EtcdTarget

    if not args.job_id:
        raise ConfigError("--etcd needs --job-id: the job whose latest pointer to read.")
    check_id("job id", args.job_id)
    ptr = LatestPointer.open(EtcdTarget(args.etcd, etcd_access.from_args(args)), args.job_id, 0, args.url)
    try:
        return ptr.latest()
    finally:
        ptr.close()


def _not_committed(loc, step: int, key=None) -> str | None:
    """Why ``step`` is not committed (its manifest is missing, damaged or not signed under ``key``),
    or None when it is."""
    try:
        mf.read_manifest(loc, step_dir(step), key)
        return None
    except CheckpointCorrupt as exc:
        return f"is not committed ({str(exc).rstrip('.')})"
