"""``python -m ftrt.grpo [--config FILE.yaml] [KEY=VALUE ...]`` (also ``ftrt grpo ...``)."""

from __future__ import annotations

import argparse
import sys

from ftrt.errors import ConfigError, FtrtError


def main(argv: list[str] | None = None, prog: str = "python -m ftrt.grpo") -> int:
    from ftrt.grpo.config import help_text, load_config

    p = argparse.ArgumentParser(
        prog=prog,
        description="Train GRPO on a verifiable task, alone or under ftrt launch (data parallel).",
        epilog="Example: ftrt launch --standalone --nproc-per-node 2 -m ftrt.grpo steps=200 "
               "checkpoint.url=/tmp/ck. --help-config lists every field.",
    )
    p.add_argument("--config", help="YAML file with config fields")
    p.add_argument("--help-config", action="store_true", help="list every config field and exit")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. checkpoint.interval=5")
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
