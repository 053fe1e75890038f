"""The package layout: every module of ftrt/, agents/, checkpoint/ and chaos/ lands in a built
wheel under the single ``ftrt`` namespace, and the committed gRPC stubs match proto/."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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


def _lock():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lock_constraints", ROOT / "scripts" / "lock_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tests_run_with_exactly_the_pinned_dependencies():
    """constraints.txt pins every distribution ftrt[test] needs (python scripts/lock_constraints.py),
    and the environment running these tests has exactly those: what passed here is what CI installs.
    CI installs with the file, so a pin that cannot install fails there."""
    lock = _lock()
    pinned, installed = lock.read(), lock.closure()
    if installed.get("torch") != pinned.get("torch"):
        pytest.skip(f"torch {installed.get('torch')} here, {pinned.get('torch')} pinned: not the CPU environment the "
                    "pins describe (a GPU machine installs its own torch stack)")
    missing = sorted(set(installed) - set(pinned))
    assert not missing, f"not pinned in constraints.txt: {missing}; run python scripts/lock_constraints.py"
    differ = sorted(f"{n}: {pinned[n]} pinned, {installed[n]} installed" for n in installed if pinned[n] != installed[n])
    assert not differ, (f"this environment is not the pinned one ({differ}): pip install -c constraints.txt -e "
                        "'.[test]', or, after changing it on purpose, python scripts/lock_constraints.py")
    assert {"torch", "grpcio-tools", "transformers", "trl"} <= set(pinned)
