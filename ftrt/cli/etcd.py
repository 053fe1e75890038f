"""``ftrt etcd``: run one local etcd member in the foreground until interrupted.

For trying a multi-node job on one machine: start ``ftrt etcd --port 2379`` in one terminal, then
``ftrt launch --etcd 127.0.0.1:2379 --node-id n0 ...`` in others.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from ftrt.store.etcd_server import EtcdServer


def etcd_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ftrt etcd", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="data directory (default: a temporary one, removed on exit)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=2379, help="client port (default 2379; 0 picks a free one)")
    parser.add_argument("--peer-port", type=int, default=0, help="peer port (default: a free one)")
    parser.add_argument("--name", default="ftrt-etcd", help="member name")
    parser.add_argument("--etcd-bin", default=None, help="etcd binary (default: the bundled one, then PATH)")
    args = parser.parse_args(argv)
    server = EtcdServer(
        name=args.name, data_dir=args.data_dir, host=args.host, client_port=args.port,
        peer_port=args.peer_port, binary=args.etcd_bin,
    )
    stop = False

    def _stop(*_):
        nonlocal stop
        stop = True

    # Handlers first: a Ctrl-C or SIGTERM right after the "serving" line is a clean stop too.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server.start()
    print(f"etcd is serving on {server.endpoint} (data in {server.data_dir}); Ctrl-C stops it.", flush=True)
    try:
        while not stop and server.alive():
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        code = server.proc.poll() if server.proc else None
        server.stop()
    if code not in (None, 0, -signal.SIGTERM):
        print(f"ftrt: error: etcd exited with code {code}.", file=sys.stderr)
        return 1
    return 0
