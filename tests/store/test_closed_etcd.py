"""The etcd that ftrt starts is closed by default (issue 32's first attack replayed): a plain HTTP
client, or a TLS one without the certificate, reads nothing; ftrt's own commands on the host find
the certificate by the endpoint, with no flags; an agent on an open etcd says so."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

from ftrt.store import localetcd
from ftrt.store.access import EtcdAccess
from ftrt.store.etcd import EtcdStore


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def kv_range(url: str, ctx: ssl.SSLContext | None = None) -> dict | Exception:
    """etcd's HTTP gateway asked for every key under ``/ftrt/``, as an attacker with curl would;
    the answer, or what stopped it."""
    body = json.dumps({"key": _b64("/ftrt/"), "range_end": _b64("/ftrt0")}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v3/kv/range", data=body), context=ctx,
                                    timeout=5) as r:
            return json.load(r)
    except (urllib.error.URLError, OSError, ssl.SSLError, ValueError) as exc:
        return exc


def test_ftrt_etcd_is_closed_by_default_and_the_hosts_ftrt_commands_need_no_flags(tmp_path, job_id):
    proc = subprocess.Popen([sys.executable, "-m", "ftrt.cli.main", "etcd", "--port", "0"], stdout=subprocess.PIPE,
                            text=True)
    try:
        out = proc.stdout.readline() + proc.stdout.readline()
        port = int(re.search(r"serving on https://127\.0\.0\.1:(\d+)", out).group(1))
        assert "closed: clients need the certificate in" in out, out
        found = localetcd.find(f"127.0.0.1:{port}")
        assert found is not None and found.cert and found.key and found.cacert
        assert localetcd.find(f"localhost:{port}") == found  # any loopback name
        assert localetcd.find(f"http://127.0.0.1:{port}") is None  # plaintext asked for: never looked up

        async def put_token():
            store = EtcdStore(f"127.0.0.1:{port}", timeout=5.0, access=found)
            try:
                await store.put(f"/ftrt/j/{job_id}/auth/token", b"s" * 64)
            finally:
                await store.close()

        asyncio.run(put_token())
        assert isinstance(kv_range(f"http://127.0.0.1:{port}"), Exception)  # plaintext: no answer
        anonymous = ssl.create_default_context(cafile=found.cacert)
        refused = kv_range(f"https://127.0.0.1:{port}", anonymous)  # TLS without the client certificate
        assert isinstance(refused, Exception), refused
        holder = ssl.create_default_context(cafile=found.cacert)
        holder.load_cert_chain(found.cert, found.key)
        answer = kv_range(f"https://127.0.0.1:{port}", holder)  # the same request with it: the key is there
        assert isinstance(answer, dict) and answer.get("count") == "1", answer

        folder = localetcd.folder("127.0.0.1", port)
        assert oct(folder.stat().st_mode & 0o777) == "0o700"
        assert {oct(p.stat().st_mode & 0o777) for p in folder.glob("*key.pem")} == {"0o600"}

        launched = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "launch", "--etcd", f"127.0.0.1:{port}",
                                   "--job-id", job_id, "--nnodes", "1", "--no-warm", "-m", "ftrt.examples.ddp_steps",
                                   "--steps", "3", "--step-time", "0.01"], capture_output=True, text=True, timeout=120)
        assert launched.returncode == 0, launched.stderr[-3000:]  # the README's launch line, no flags
        assert "anyone who can reach it" not in launched.stderr, launched.stderr[-3000:]
        status = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "status", "--etcd", f"127.0.0.1:{port}",
                                 "--job-id", job_id, "--json"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr[-2000:]
        assert json.loads(status.stdout)["job_id"] == job_id
        elsewhere = {**os.environ, "FTRT_STATE_DIR": str(tmp_path / "another-user")}  # no certificate
        refused = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "status", "--etcd", f"127.0.0.1:{port}",
                                  "--job-id", job_id, "--json"], capture_output=True, text=True, timeout=60,
                                 env=elsewhere)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0


def test_ftrt_etcd_insecure_is_open_says_so_and_leaves_no_credentials_behind(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "ftrt.cli.main", "etcd", "--port", "0", "--insecure"],
                            stdout=subprocess.PIPE, text=True)
    try:
        out = proc.stdout.readline() + proc.stdout.readline()
        port = int(re.search(r"serving on 127\.0\.0\.1:(\d+)", out).group(1))
        assert "anyone who can reach this port" in out, out
        assert localetcd.find(f"127.0.0.1:{port}") is None
        assert isinstance(kv_range(f"http://127.0.0.1:{port}"), dict)  # open, as it said
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0


def test_an_agent_on_an_etcd_that_admits_anyone_warns_unless_told_it_is_meant(tmp_path, etcd_endpoint, job_id):
    script = tmp_path / "noop.py"
    script.write_text("print('trained')\n")

    def launch(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ftrt.cli.main", "launch", "--etcd", etcd_endpoint,
                               "--job-id", f"{job_id}-{len(extra)}", "--nnodes", "1", "--no-warm", *extra,
                               str(script)], capture_output=True, text=True, timeout=120)

    warned = launch()
    assert warned.returncode == 0, warned.stderr[-3000:]
    assert "anyone who can reach it can read the job's token" in warned.stderr, warned.stderr[-3000:]
    quiet = launch("--insecure-etcd")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "anyone who can reach it" not in quiet.stderr, quiet.stderr[-3000:]


def test_the_credentials_of_an_endpoint_are_found_by_any_of_its_spellings(tmp_path):
    env = {"FTRT_STATE_DIR": str(tmp_path)}
    files = localetcd.make("127.0.0.1", 4321, env)
    want = EtcdAccess(cacert=str(files.ca), cert=str(files.client_cert("ftrt")), key=str(files.client_key("ftrt")))
    for spelling in ("127.0.0.1:4321", "https://localhost:4321", "[::1]:4321,127.0.0.1:4322"):
        assert localetcd.find(spelling, env) == want, spelling
    assert localetcd.find("127.0.0.1:4322", env) is None and localetcd.find("nonsense", env) is None
    localetcd.forget("localhost", 4321, env)
    assert localetcd.find("127.0.0.1:4321", env) is None


def test_a_name_clients_on_other_hosts_dial_goes_into_etcds_certificate_kept_or_not(tmp_path):
    """``ftrt etcd --cert-host NAME`` (the Slurm script's head node): the server certificate names
    it, also when the folder already held a certificate without it (reissued under the same CA)."""
    from cryptography import x509

    def names(files) -> set[str]:
        cert = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
        return {str(getattr(n.value, "exploded", n.value))
                for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}

    env = {"FTRT_STATE_DIR": str(tmp_path)}
    first = localetcd.make("0.0.0.0", 23790, env)
    ca = first.ca.read_bytes()
    assert "head-7" not in names(first) and "127.0.0.1" in names(first)
    again = localetcd.make("0.0.0.0", 23790, env, extra_hosts=["head-7", "10.1.2.3"])
    assert {"head-7", "10.1.2.3", "127.0.0.1"} <= names(again)
    assert again.ca.read_bytes() == ca  # the clients' certificates stay valid
