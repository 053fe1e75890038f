"""``ftrt ckpt ls|inspect|verify URL [STEP]``: look at and check checkpoints without a job.

``verify`` exits non-zero naming the bad step and file; ``ls`` marks folders without a valid
manifest as not committed (restore ignores them).
"""

from __future__ import annotations

import argparse
import json
import time

from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.storage import list_steps, parse_url, step_dir
from ftrt.errors import CheckpointCorrupt, ConfigError


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
    p = argparse.ArgumentParser(prog="ftrt ckpt", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("ls", "inspect", "verify"))
    p.add_argument("url", help="checkpoint URL (path, file://, s3://bucket/prefix)")
    p.add_argument("step", nargs="?", type=int, help="step (default: the newest committed)")
    p.add_argument("--storage-options", default=None, help="fsspec options as JSON")
    args = p.parse_args(argv)
    loc = parse_url(args.url, _storage_options(args.storage_options))
    steps = list_steps(loc)
    if args.action == "ls":
        if not steps:
            print(f"no checkpoints under {args.url}")
            return 0
        for s in steps:
            try:
                m = mf.read_manifest(loc, step_dir(s))
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.time))
                print(f"step {s:>10}  committed  {when}  world {m.world_size:>3}  {_human(m.total_bytes):>10}  {len(m.files)} files")
            except CheckpointCorrupt as exc:
                print(f"step {s:>10}  NOT COMMITTED  ({exc})")
        return 0
    step = args.step
    if step is None:
        committed = [s for s in steps if _committed(loc, s)]
        if not committed:
            raise CheckpointCorrupt(f"No committed checkpoint under {args.url}.")
        step = committed[-1]
    if step not in steps:
        raise ConfigError(f"There is no checkpoint step {step} under {args.url} (steps: {steps or 'none'}).")
    m = mf.read_manifest(loc, step_dir(step))
    if args.action == "inspect":
        body = json.loads(m.to_json())
        body["total_bytes"] = m.total_bytes
        print(json.dumps(body, indent=2))
        return 0
    t0 = time.monotonic()
    mf.verify_files(loc, step_dir(step), m, sorted(m.files))
    print(f"step {step}: {len(m.files)} files, {_human(m.total_bytes)}, all sizes and checksums match "
          f"({time.monotonic() - t0:.2f} s)")
    return 0


def _committed(loc, step: int) -> bool:
    try:
        mf.read_manifest(loc, step_dir(step))
        return True
    except CheckpointCorrupt:
        return False
