"""``python -m ftrt.grpo [--config FILE.yaml] [KEY=VALUE ...]`` (also ``ftrt grpo ...``)."""

from __future__ import annotations

import argparse
import sys

from ftrt.errors import ConfigError, FtrtError


def main(argv: list[str] | None = None, prog: str = "python -m ftrt.grpo") -> int:
    from ftrt.grpo.config import add_arguments, help_text, load_config

    p = argparse.ArgumentParser(
        prog=prog,
        description="Train GRPO on a verifiable task, alone or under ftrt launch (data parallel).",
        epilog="Example: ftrt launch --standalone --nproc-per-node 2 -m ftrt.grpo steps=200 "
               "checkpoint.url=/tmp/ck. --help-config lists every field.",
    )
    add_arguments(p)
    args = p.parse_args(argv)
    if args.help_config:
        print(help_text())
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        from ftrt.grpo.trainer import train

        train(cfg)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2  # a usage error: under ftrt launch, the job fails at once instead of restarting
    except FtrtError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
