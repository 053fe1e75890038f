"""The rollout fleet's pure parts: the weight codec, the dispatch ledger and routing, the spec."""

from __future__ import annotations

import pytest
import torch

from ftrt.errors import ConfigError
from ftrt.grpo.config import load_config
from ftrt.rollout.ledger import GroupKey, Ledger, ServerView, next_push, route
from ftrt.rollout.records import ServerRecord
from ftrt.policy.spec import PolicySpec, decode_spec
from ftrt.rollout.weights import Assembler, Outgoing, PushRefused, chunks, expected_of
from ftrt.v1 import rollout_pb2


def _state():
    torch.manual_seed(0)
    return {"a.weight": torch.randn(300, 700), "a.bias": torch.randn(700), "n": torch.tensor([3, 4]),
            "h": torch.randn(5, 5).to(torch.bfloat16)}


def test_a_push_round_trips_every_tensor_bit_for_bit():
    state = _state()
    out = Outgoing(7, state)
    asm = Assembler(expected_of(state))
    msgs = list(chunks(out, keep_from=6, piece=100_000))
    assert len(msgs) > 10  # a.weight spans several messages
    for m in msgs:
        asm.feed(m)
    got = asm.result()
    assert asm.version == 7 and asm.digest == out.digest and asm.keep_from == 6
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def _feed_all(asm, msgs):
    for m in msgs:
        asm.feed(m)
    return asm.result()


def test_a_truncated_push_is_refused_and_nothing_is_handed_out():
    state = _state()
    msgs = list(chunks(Outgoing(1, state), keep_from=0, piece=100_000))
    with pytest.raises(PushRefused, match="before its commit"):
        _feed_all(Assembler(expected_of(state)), msgs[:-1])
    with pytest.raises(PushRefused, match="committed in the middle|committed without"):
        _feed_all(Assembler(expected_of(state)), [*msgs[:3], msgs[-1]])


def test_a_corrupted_byte_is_caught_by_the_tensor_sha256():
    state = _state()
    msgs = list(chunks(Outgoing(1, state), keep_from=0, piece=100_000))
    bad = rollout_pb2.WeightChunk()
    bad.CopyFrom(msgs[2])
    data = bytearray(bad.data)
    data[10] ^= 0x01
    bad.data = bytes(data)
    msgs[2] = bad
    with pytest.raises(PushRefused, match="SHA-256"):
        _feed_all(Assembler(expected_of(state)), msgs)


def test_a_push_of_another_model_is_refused():
    state = _state()
    other = {**state, "a.bias": torch.randn(701)}
    with pytest.raises(PushRefused, match="a.bias"):
        _feed_all(Assembler(expected_of(state)), list(chunks(Outgoing(1, other), keep_from=0)))
    fewer = {k: v for k, v in state.items() if k != "n"}
    with pytest.raises(PushRefused, match="3 tensors"):
        _feed_all(Assembler(expected_of(state)), list(chunks(Outgoing(1, fewer), keep_from=0)))
    with pytest.raises(PushRefused, match="header"):
        _feed_all(Assembler(expected_of(state)), list(chunks(Outgoing(1, state), keep_from=0))[1:])


def test_a_forged_digest_is_refused():
    state = _state()
    msgs = list(chunks(Outgoing(1, state), keep_from=0))
    msgs[0] = rollout_pb2.WeightChunk(version=1, digest="0" * 64, tensors=len(state))
    with pytest.raises(PushRefused, match="digest"):
        _feed_all(Assembler(expected_of(state)), msgs)


def test_the_ledger_gives_each_group_one_result_and_requeues_failures():
    led = Ledger()
    led.add(3, [10, 11], version=3)
    assert [k for k, _ in led.waiting()] == [GroupKey(3, 10), GroupKey(3, 11)]
    led.sent(GroupKey(3, 10), "s0", deadline=5.0)
    led.sent(GroupKey(3, 11), "s1", deadline=5.0)
    assert led.waiting() == [] and led.inflight() == {"s0": 1, "s1": 1}
    led.failed(GroupKey(3, 10), "s0")  # s0 died
    assert led.waiting() == [(GroupKey(3, 10), 3)] and led.redispatched[3] == 1
    led.sent(GroupKey(3, 10), "s1", deadline=9.0)
    assert led.answered(GroupKey(3, 10), "s1", torch.ones(2, 2))
    assert not led.answered(GroupKey(3, 10), "s0", torch.zeros(2, 2))  # a late duplicate is dropped
    assert led.overdue(6.0) == [(GroupKey(3, 11), "s1")]
    assert not led.done(3)
    led.failed(GroupKey(3, 11), "s1")
    led.sent(GroupKey(3, 11), "s0", deadline=20.0)
    led.failed(GroupKey(3, 11), "s1")  # a stale failure from the old server changes nothing
    assert led.inflight() == {"s0": 1}
    assert led.answered(GroupKey(3, 11), "s0", torch.zeros(2, 2))
    assert led.done(3) and torch.equal(led.results(3)[10], torch.ones(2, 2))
    led.forget(3)
    assert not led.has(3)


def test_routing_takes_only_servers_that_hold_the_version_and_have_room():
    waiting = [(GroupKey(1, i), 1) for i in range(5)] + [(GroupKey(2, 0), 2)]
    servers = [ServerView("a", frozenset({1}), 0, True), ServerView("b", frozenset({1, 2}), 1, True),
               ServerView("c", frozenset({1, 2}), 0, False)]
    got = route(waiting, servers, per_server=2)
    assert got == [(GroupKey(1, 0), "a"), (GroupKey(1, 1), "a"), (GroupKey(1, 2), "b")]
    assert route(waiting, [ServerView("c", frozenset({1}), 0, False)], 2) == []


def test_the_spec_and_server_records_from_etcd_are_checked():
    spec = PolicySpec.of(load_config(None, ["group_size=4"]))
    assert decode_spec(spec.encode(), "k") == spec
    with pytest.raises(ConfigError, match="not JSON"):
        decode_spec(b"\x80\x04pickle", "k")
    with pytest.raises(ConfigError, match="group_size"):
        decode_spec(spec.encode().replace(b'"group_size": 4', b'"group_size": -1'), "k")
    rec = ServerRecord("s0", "127.0.0.1:5", "builtin", {3: "ab"}, 42)
    assert ServerRecord.decode(rec.encode()) == rec
    with pytest.raises((ValueError, ConfigError)):
        ServerRecord.decode(rec.encode().replace(b'"s0"', b'"../x"'))
    with pytest.raises(ValueError):
        ServerRecord.decode(rec.encode().replace(b"127.0.0.1:5", b"nowhere"))


def test_off_policy_steps_need_the_fleet():
    with pytest.raises(ConfigError, match="max_off_policy_steps"):
        load_config(None, ["rollout.max_off_policy_steps=1"])


def test_a_push_is_a_snapshot_the_trainer_may_change_its_weights_meanwhile():
    """The CRC caught this once: a push read the live parameters while the optimizer stepped."""
    state = _state()
    out = Outgoing(1, state)
    for v in state.values():
        v.zero_() if v.dtype != torch.bool else None
    got = _feed_all(Assembler(expected_of(state)), list(chunks(out, keep_from=0)))
    assert not torch.equal(got["a.weight"], state["a.weight"])  # the bytes of version 1, not today's


def test_what_a_server_is_pushed_next_depends_on_how_many_versions_it_holds():
    # several: every kept version, newest first
    assert next_push(10, set(), [5, 4], {4, 5}) == 5
    assert next_push(10, {5}, [5, 4], {4, 5}) == 4
    assert next_push(10, {4, 5}, [5, 4], {4}) is None
    # one (vLLM): keep the version while a group wants it, then the oldest wanted, never back and forth
    assert next_push(1, {4}, [5, 4], {4, 5}) is None
    assert next_push(1, set(), [5, 4], {4, 5}) == 4
    assert next_push(1, {4}, [5, 4], {5}) == 5
    assert next_push(1, {5}, [5, 4], {5}) is None
    assert next_push(1, set(), [5], set()) == 5  # nothing waits: the newest, ready for what comes


def test_a_push_is_judged_against_the_versions_the_trainer_claims():
    from ftrt.rollout.claims import decode, encode, judge

    real = Outgoing(3, _state()).digest
    zeroed = Outgoing(3, {k: torch.zeros_like(v) for k, v in _state().items()}).digest
    claimed = decode(encode({2: "e" * 64, 3: real}))
    assert claimed == {2: "e" * 64, 3: real}
    assert judge(claimed, 3, real) is None
    assert "the weights were changed" in judge(claimed, 3, zeroed)
    assert "the trainer made no version 4 (it claims 2, 3)" in judge(claimed, 4, real)
    assert "claims no weight version" in judge(None, 3, real)
    for bad in (b'{"versions": {"x": "00"}}', b'{"versions": {"1": "short"}}', b"[]"):
        with pytest.raises(ValueError):
            decode(bad)


@pytest.mark.parametrize("argv,needle", [
    (["--engine", "vllm"], "--engine vllm needs exactly one of --vllm-url"),
    (["--engine", "vllm", "--vllm-url", "http://127.0.0.1:1", "--vllm-python", "python3"], "got --vllm-python and "
     "--vllm-url"),
    (["--vllm-python", "python3"], "--vllm-python is for --engine vllm"),
])
def test_engine_flags_that_cannot_work_are_refused_before_waiting_for_the_trainer(argv, needle, etcd_endpoint):
    import subprocess
    import sys

    # the job has no trainer: a server that got as far as waiting for its spec would never return
    res = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "rollout", "serve", "--etcd", etcd_endpoint,
                          "--job-id", "nobody", *argv], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_vllm_engine_that_cannot_start_leaves_no_temporary_folder(tmp_path, monkeypatch):
    import socket
    import tempfile

    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from ftrt.rollout.server import build_engine, build_parser
    from ftrt.rollout.vllm_engine import EngineFailed
    from tests.grpo.test_hf_policy import save_task_tokenizer
    import transformers

    model = tmp_path / "models" / "gpt2"
    words = save_task_tokenizer(model)
    cfg = transformers.GPT2Config(vocab_size=len(words), n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                  bos_token_id=2, eos_token_id=3, pad_token_id=1)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(model)
    spec = PolicySpec.of(load_config(None, [f"model.hf_path={model}", "task.params={length: 3, alphabet: 6}"]))
    with socket.socket() as s:  # a port nobody serves
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    ns = build_parser().parse_args(["--etcd", "127.0.0.1:1", "--job-id", "j", "--engine", "vllm", "--vllm-url",
                                    f"http://127.0.0.1:{port}", "--vllm-ready-timeout", "0.5",
                                    "--model-dir", str(tmp_path / "models")])
    with pytest.raises(EngineFailed, match="was not ready after 0.5 s"):
        build_engine(ns, spec)
    assert list(tmp.iterdir()) == []  # the folder for pushed weights went with the engine
