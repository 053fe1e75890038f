"""``ftrt etcd``: run one local etcd member in the foreground until interrupted.

For trying a multi-node job on one machine: start ``ftrt etcd --port 2379`` in one terminal, then
``ftrt launch --etcd 127.0.0.1:2379 --node-id n0 ...`` in others.

Closed by default: etcd serves clients over TLS and requires a client certificate signed by a CA
made for it in this user's state directory (:mod:`ftrt.store.localetcd`), which ftrt's commands on
this host find by the endpoint, so they need no flags; a process that cannot read that folder can
neither read nor write etcd (the job's token is there). ``--tls DIR`` puts the CA and certificates
in DIR instead (:mod:`ftrt.store.certs`); ``--etcd-user NAME`` also turns etcd's auth on, with NAME
allowed to read and write ``/ftrt/``. ``--insecure`` serves plaintext to anyone who reaches the
port. The command prints the ``--etcd*`` flags an agent on another host needs; ``--cert-host NAME``
puts the name those agents dial it by into its certificate (deploy/slurm/ftrt.sbatch: the head
node's).
"""

from __future__ import annotations

import argparse
import errno
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

from ftrt.helptext import help_summary
from ftrt.errors import ConfigError
from ftrt.store import localetcd
from ftrt.store.access import ENV_PASSWORD
from ftrt.store.etcd_server import EtcdServer, write_secret


def _port(text: str) -> int:
    """An argparse type: a TCP port number, 0 for a free one."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: give 1-65535, or 0 for a free one") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number: give 1-65535, or 0 for a free one")
    return port


def _check_free(host: str, port: int, flag: str) -> None:
    """Refuse a port something already listens on (etcd would exit, or another etcd would answer
    the health check in its place)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as etcd binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{flag} {port}: etcd cannot listen on {host}:{port}: something there already does "
                                  f"(another etcd?). Stop it, or pick another port ({flag} 0 picks a free one).") from None
            raise ConfigError(f"{flag} {port}: etcd cannot listen on {host}:{port} ({exc.strerror or exc}); check "
                              "--host (an address of this machine).") from None


def etcd_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ftrt etcd", description=help_summary(__doc__))
    parser.add_argument("--data-dir", default=None, help="data directory (default: a temporary one, removed on exit)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=2379, help="client port (default 2379; 0 picks a free one)")
    parser.add_argument("--peer-port", type=_port, default=0, help="peer port (default: a free one)")
    parser.add_argument("--name", default="ftrt-etcd", help="member name")
    parser.add_argument("--etcd-bin", default=None, help="etcd binary (default: the bundled one, then PATH)")
    parser.add_argument("--tls", default=None, metavar="DIR",
                        help="serve clients over TLS with client certificates; makes a CA and certificates in "
                             "DIR unless it has them")
    parser.add_argument("--etcd-user", "--auth-user", dest="auth_user", default=None, metavar="NAME",
                        help=f"turn etcd's auth on with this user (read and write on /ftrt/); its password comes "
                             f"from ${ENV_PASSWORD} or --etcd-password-file (root's is written to DIR/root-password); "
                             "clients then pass the same --etcd-user and --etcd-password-file")
    parser.add_argument("--etcd-password-file", "--password-file", dest="password_file", default=None,
                        metavar="FILE", help="file with --etcd-user's password")
    parser.add_argument("--cert-host", action="append", default=[], metavar="NAME",
                        help="a host name or address clients on other hosts dial this etcd at, which its server "
                             "certificate must name (repeatable; e.g. the node's name when --host is 0.0.0.0)")
    parser.add_argument("--insecure", action="store_true",
                        help="serve plaintext without client certificates: anyone who reaches the port can read "
                             "the job's token and join or rewrite the job (default: closed, see ftrt/store/localetcd.py)")
    args = parser.parse_args(argv)
    if args.insecure and (args.tls or args.auth_user):
        raise ConfigError("--insecure serves plaintext to anyone; it cannot go with --tls or --etcd-user.")
    if args.insecure and args.cert_host:
        raise ConfigError("--cert-host names hosts in etcd's certificate, but --insecure serves plaintext without one.")
    if args.auth_user == "root":
        raise ConfigError("--etcd-user root: etcd's root user is made for you (its password goes to DIR/root-password); "
                          "name the job's user something else.")
    if args.auth_user and not args.tls:
        raise ConfigError("--etcd-user needs --tls DIR: etcd's passwords must not cross the network in plaintext.")
    if args.auth_user and args.data_dir and Path(args.data_dir).exists() and any(Path(args.data_dir).iterdir()):
        raise ConfigError(f"--etcd-user sets up users in a new etcd, but --data-dir {args.data_dir} holds one "
                          "already (with whatever users it has); give an empty or new folder.")
    password = ""
    if args.auth_user:
        if args.password_file:
            lines = Path(args.password_file).read_text().splitlines() if Path(args.password_file).is_file() else []
            password = lines[0] if lines else ""
            if not password:
                raise ConfigError(f"--etcd-password-file {args.password_file} is missing or empty; put the password "
                                  "on its first line.")
        else:
            password = os.environ.get(ENV_PASSWORD, "")
            if not password:
                raise ConfigError(f"--etcd-user {args.auth_user} needs a password: set {ENV_PASSWORD} or pass "
                                  "--etcd-password-file FILE.")
    _check_free(args.host, args.port, "--port")
    _check_free(args.host, args.peer_port, "--peer-port")
    server = EtcdServer(
        name=args.name, data_dir=args.data_dir, host=args.host, client_port=args.port,
        peer_port=args.peer_port, binary=args.etcd_bin,
    )  # its free ports are picked here: the default credentials are the endpoint's
    if args.tls:
        from ftrt.store.certs import tls_dir

        try:
            server.tls = tls_dir(args.tls, hosts=(args.host, *args.cert_host))
        except OSError as exc:
            raise ConfigError(f"--tls {args.tls}: cannot make or read the certificates there ({exc.strerror}"
                              f"{': ' + str(exc.filename) if exc.filename else ''}); give a folder this user can "
                              "create and write.") from None
    elif args.insecure:
        localetcd.forget(args.host, server.client_port)  # clients must not try credentials it ignores
    else:
        server.tls = localetcd.make(args.host, server.client_port, extra_hosts=args.cert_host)
    tls = server.tls
    stop = False

    def _stop(*_):
        nonlocal stop
        stop = True

    # Handlers first: a Ctrl-C or SIGTERM right after the "serving" line is a clean stop too.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        server.start()
    except BaseException:
        server.stop()  # its folder and its kept output go
        raise
    try:
        if args.auth_user:
            root = secrets.token_urlsafe(24)
            write_secret(Path(args.tls) / "root-password", root)
            server.enable_auth(root, {args.auth_user: password})
        where = server.url if tls is not None else server.endpoint  # what --etcd takes
        print(f"etcd is serving on {where} (data in {server.data_dir}); Ctrl-C stops it.", flush=True)
        if tls is not None:
            flags = [f"--etcd {server.url}", f"--etcd-cacert {tls.ca}", f"--etcd-cert {tls.client_cert()}",
                     f"--etcd-key {tls.client_key()}"]
            if args.auth_user:
                flags.append(f"--etcd-user {args.auth_user} (password from ${ENV_PASSWORD} or --etcd-password-file)")
            if not args.tls:
                print(f"closed: clients need the certificate in {tls.directory} (this user's ftrt commands on this "
                      f"host find it for --etcd {server.endpoint}); agents on other hosts connect with copies: "
                      + " ".join(flags), flush=True)
            else:
                print("agents connect with: " + " ".join(flags), flush=True)
        else:
            print("warning: --insecure: anyone who can reach this port can read the job's token and join or rewrite "
                  "the job.", flush=True)
        while not stop and server.alive():
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        code = server.proc.poll() if server.proc else None
        said = server.stderr_tail() if code not in (None, 0, -signal.SIGTERM) else ""
        server.stop()
    if code not in (None, 0, -signal.SIGTERM):
        print(f"ftrt: error: etcd exited with code {code}" + (f"; it said: {said}" if said else "") + ".",
              file=sys.stderr)
        return 1
    return 0
