"""The etcd member ftrt starts (``ftrt.store.etcd_server``): it dies with the process that started
it, even by SIGKILL, and its temporary folder does not outlive that process's next start of one."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ftrt.procs import alive
from ftrt.store.etcd_server import TMP_PREFIX, EtcdServer
from ftrt.tmpdirs import abandoned, owner, sweep
from tests.agents.harness import wait_until

OWNER = """
import sys, time
from ftrt.store.etcd_server import EtcdServer
server = EtcdServer(name="orphan", unsafe_no_fsync=True).start()
print(server.proc.pid, server.data_dir, flush=True)
time.sleep(600)
"""


def test_a_member_dies_with_its_sigkilled_owner_and_the_next_start_removes_its_folder(tmp_path, monkeypatch):
    # a temporary directory of the test's own: no other process sweeps or fills it meanwhile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        pid, data = proc.stdout.readline().split()
        pid = int(pid)
        folder = Path(data).parent
        assert owner(folder.name, TMP_PREFIX) == proc.pid
    finally:
        proc.kill()  # SIGKILL: no cleanup of its own runs
        proc.wait()
    wait_until(lambda: not alive(pid), 30, "the etcd member to die with its owner")
    assert folder.exists()  # nothing could remove it at the kill
    wait_until(lambda: abandoned(folder), 10, "the folder's lock to be free and a second old")
    with EtcdServer(name="next", unsafe_no_fsync=True) as other:  # any later start sweeps it
        assert not folder.exists()
        mine = Path(other.data_dir).parent
        assert mine.exists() and owner(mine.name, TMP_PREFIX) == os.getpid()
        assert sweep(TMP_PREFIX) == []  # a folder whose owner runs stays
        assert Path(data).parent.parent == tmp_path
    assert not mine.exists()  # stop removes its own


def test_an_etcd_that_fails_to_start_says_why(tmp_path):
    import socket

    import pytest

    from ftrt.errors import FtrtError

    with socket.socket() as busy:  # etcd's own check: its client port is taken
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = EtcdServer(name="busy", client_port=busy.getsockname()[1])
        with pytest.raises(FtrtError) as err:
            server.start(timeout=30)
        server.stop()
    assert "exited with code" in str(err.value) and "it said:" in str(err.value), str(err.value)
    assert "address already in use" in str(err.value).lower(), str(err.value)


def test_etcd_s_fatal_json_log_line_is_given_as_its_message_and_error(tmp_path):
    import pytest

    from ftrt.errors import FtrtError

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    server = EtcdServer(name="nodir", data_dir=str(blocker / "data"))
    with pytest.raises(FtrtError) as err:
        server.start(timeout=30)
    server.stop()
    said = str(err.value).split("it said: ", 1)[1]
    # e.g. "failed to list data directory: open .../file/data: not a directory" (the words vary by version)
    assert "data directory" in said and said.rstrip(".").endswith("not a directory"), said
    assert "{" not in said and '"level"' not in said, said
