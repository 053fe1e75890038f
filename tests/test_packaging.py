"""The package layout: every module of ftrt/, agents/, checkpoint/ and chaos/ lands in a built
wheel under the single ``ftrt`` namespace, and the committed gRPC stubs match proto/."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPING = {"ftrt": "ftrt", "agents": "ftrt/agents", "checkpoint": "ftrt/checkpoint", "chaos": "ftrt/chaos"}


def expected_modules() -> set[str]:
    out = set()
    for src, dest in MAPPING.items():
        for path in (ROOT / src).rglob("*.py"):
            rel = path.relative_to(ROOT / src)
            if "__pycache__" in rel.parts:
                continue
            out.add(f"{dest}/{rel.as_posix()}")
    return out


def test_every_module_is_in_the_wheel(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    wheel = next(tmp_path.glob("ftrt-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(expected_modules() - names)
    assert not missing, f"modules missing from the wheel (add their packages to pyproject.toml): {missing}"
    assert "ftrt/v1/agent_pb2.pyi" in names or "ftrt/v1/agent_pb2.py" in names


def test_committed_grpc_stubs_are_up_to_date():
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True, text=True,
    )
    assert res.returncode == 0, f"run scripts/gen_proto.py: {res.stdout}{res.stderr}"


def test_console_script_reports_version():
    from ftrt import __version__

    res = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == f"ftrt {__version__}"
