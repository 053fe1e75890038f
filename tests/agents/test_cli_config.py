"""``ftrt launch``'s flags against :class:`LaunchConfig`: every field has a flag (or a reason), every
flag's default is its field's, and torchrun's spellings still parse."""

from __future__ import annotations

import logging

import pytest

from ftrt.agents.cli import build_parser, parse_launch_args
from ftrt.agents.config import LaunchConfig, load_config
from ftrt.agents.launch_flags import FLAGS, IGNORED, NO_FLAG, Flag
from ftrt.errors import ConfigError
from ftrt.store import access


@pytest.fixture
def no_access_env(monkeypatch):
    """The --etcd-* flags fall back on FTRT_ETCD_* variables; a test's config must not see the caller's."""
    for name in (access.ENV_CACERT, access.ENV_CERT, access.ENV_KEY, access.ENV_USER, access.ENV_PASSWORD,
                 access.ENV_PASSWORD_FILE, access.ENV_TLS):
        monkeypatch.delenv(name, raising=False)


def test_every_config_field_has_a_flag_or_a_reason_for_none():
    flagged = [field for flag in FLAGS for field in flag.config_fields]
    assert len(flagged) == len(set(flagged)), f"a field set by two flags: {sorted(flagged)}"
    assert not set(flagged) & set(NO_FLAG), "a field both flagged and in NO_FLAG"
    missing = set(LaunchConfig.model_fields) - set(flagged) - set(NO_FLAG)
    assert not missing, f"LaunchConfig fields without a flag (add one to FLAGS, or say why in NO_FLAG): {missing}"
    unknown = (set(flagged) | set(NO_FLAG)) - set(LaunchConfig.model_fields)
    assert not unknown, f"flags for fields LaunchConfig does not have: {unknown}"


@pytest.mark.parametrize("flag", [f for f in FLAGS if isinstance(f, Flag) and f.default is not None],
                         ids=lambda f: f.names[0])
def test_a_flags_default_is_its_fields_default(flag):
    assert build_parser().get_default(flag.dest) == flag.default
    for field, value in flag.config_values(flag.default).items():
        assert LaunchConfig.model_fields[field].default == value, field


def test_no_flags_give_the_config_its_own_defaults(no_access_env):
    """Flags whose default is None (--node-id, --warm-import, ...) leave the config's own default."""
    assert parse_launch_args(["--standalone", "-m", "m"]) == load_config(standalone=True, module="m")


def test_help_lists_every_flag_and_hides_the_ignored_ones():
    text = build_parser().format_help()
    shown = [n for flag in FLAGS if isinstance(flag, Flag) for n in flag.names]
    shown += ["--etcd-cacert", "--etcd-user", "--etcd-password-file", "--tls-cert", "--tls-ca", "--module"]
    assert [n for n in shown if n not in text] == []
    assert [n for names in IGNORED for n in names if n in text] == []
    assert "seconds a silent node stays a member (default 5)" in text  # {default}, shown as typed


def _sample(flag: Flag) -> list[str]:
    if flag.action in ("store_true", "store_false"):
        return []
    return ["2:3"] if flag.dest == "nnodes" else ["7"]


@pytest.mark.parametrize("flag,alias", [(f, n) for f in FLAGS if isinstance(f, Flag) for n in f.names[1:]],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_an_alias_parses_as_its_flag(flag, alias):
    parser = build_parser()
    assert parser.parse_args([alias, *_sample(flag), "x.py"]) == parser.parse_args([flag.names[0], *_sample(flag),
                                                                                     "x.py"])


@pytest.mark.parametrize("argv,field,value", [
    (["--rdzv-endpoint", "h:2379"], "etcd", "h:2379"),
    (["--rdzv_endpoint", "h:2379"], "etcd", "h:2379"),
    (["--etcd", "h:1", "--rdzv-id", "run7"], "job_id", "run7"),
    (["--etcd", "h:1", "--rdzv_id", "run7"], "job_id", "run7"),
    (["--etcd", "h:1", "--run-id", "run7"], "job_id", "run7"),
    (["--etcd", "h:1", "--nproc_per_node", "4"], "nproc_per_node", 4),
    (["--etcd", "h:1", "--node_id", "n3"], "node_id", "n3"),
    (["--etcd", "h:1", "--max_restarts", "5"], "max_restarts", 5),
    (["--etcd", "h:1", "--lease_ttl", "7"], "lease_ttl", 7.0),
    (["--etcd", "h:1", "--log_dir", "logs"], "log_dir", "logs"),
    (["--etcd", "h:1", "--local-addr", "10.0.0.1"], "host", "10.0.0.1"),
    (["--etcd", "h:1", "--local_addr", "10.0.0.1"], "host", "10.0.0.1"),
    (["--etcd", "h:1", "--nnodes", "2:8"], "min_nodes", 2),
    (["--etcd", "h:1", "--nnodes", "2:8"], "max_nodes", 8),
    (["--etcd", "h:1", "--no-warm"], "warm_workers", False),
    (["--etcd", "h:1", "--warm-import", "a", "--warm-import", "b"], "warm_imports", ("a", "b")),
])
def test_torchrun_spellings_set_the_config(argv, field, value, no_access_env):
    assert getattr(parse_launch_args([*argv, "-m", "x"]), field) == value


def test_torchrun_backend_options_are_ignored_with_a_note(caplog, no_access_env):
    with caplog.at_level(logging.INFO, logger="ftrt.agents.cli"):
        cfg = parse_launch_args(["--etcd", "h:1", "--rdzv-backend", "c10d", "--rdzv_conf", "timeout=9", "-m", "x"])
    assert cfg.etcd == "h:1"
    assert "--rdzv-backend is a torchrun option and is ignored" in caplog.text
    assert "--rdzv-conf is a torchrun option and is ignored" in caplog.text


@pytest.mark.parametrize("argv,needle", [
    (["--nnodes", "two"], "--nnodes 'two' is not N or MIN:MAX"),
    (["--nnodes", "0:2"], "--nnodes '0:2': MIN must be at least 1"),
    (["--lease-ttl", "0.5"], "lease-ttl=0.5"),
    (["--mtbf", "0"], "mtbf=0.0"),
    (["--metrics-port", "70000"], "metrics-port=70000"),
    (["--job-id", "a/b"], "job id 'a/b' is not valid"),
])
def test_a_bad_value_is_a_config_error_that_names_it(argv, needle, no_access_env):
    with pytest.raises(ConfigError) as err:
        parse_launch_args(["--etcd", "h:1", *argv, "-m", "x"])
    assert needle in str(err.value)
