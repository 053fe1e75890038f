"""``python -m bench NAME [options]``: run one benchmark (``recovery``, ``ckpt_stall``, ``restore``, ``rollout``, ``rdzv_scale``), or ``all``."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    names = {"recovery": "bench.recovery", "ckpt_stall": "bench.ckpt_stall", "restore": "bench.restore", "rollout": "bench.rollout",
             "rdzv_scale": "bench.rdzv_scale"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*names, "all"):
        print(f"usage: python -m bench {{{','.join(names)},all}} [options]")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    targets = list(names) if argv[0] == "all" else [argv[0]]
    for name in targets:
        code = importlib.import_module(names[name]).main(argv[1:] if name == argv[0] else [])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
