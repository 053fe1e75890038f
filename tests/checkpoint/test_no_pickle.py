"""Nothing from outside is unpickled: a malicious pickle planted in a memory index, in a peer's
replica (over real gRPC) or in DCP's ``.metadata`` is refused, and its side effect never happens.
Replicas are also checked for their names, sizes and checksums before anything is stored."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import hashlib

import grpc
import grpc.aio
import pytest
import torch

from ftrt.auth import JobToken
from ftrt.agents.peers.claims import Claim
from ftrt.checkpoint import Checkpointer, memtier, skeleton
from ftrt.checkpoint.memindex import BadIndex, check_index
from ftrt.checkpoint.storage import step_dir
from ftrt.errors import ConfigError
from ftrt.v1 import agent_pb2, agent_pb2_grpc
from ftrt.store.memory import MemoryStore
from tests.agents.replicas import registered, replica_server
from tests.checkpoint.test_checkpointer import fresh_state, make_state, same_params


class Planted:
    """A pickle that, when loaded, creates ``path``: the side effect an attacker would choose."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def planted(path) -> bytes:
    return pickle.dumps(Planted(str(path)))


def test_the_skeleton_is_json_and_round_trips_an_optimizers_state():
    state = make_state()
    sd = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict(), "meta": state["meta"],
          "odd": {1: (None, True, 2.5, "x"), (1, 2): [float("inf")]}}
    tensors, encoded = memtier.flatten(sd)
    text = json.dumps(encoded)  # plain JSON, no pickle anywhere
    back = memtier.unflatten(json.loads(text), tensors)
    assert back["optim"]["param_groups"] == sd["optim"]["param_groups"]  # tuples (betas), None, bools
    assert list(back["optim"]["state"]) == list(sd["optim"]["state"])  # int keys stay ints
    assert back["odd"] == sd["odd"] and back["meta"] == sd["meta"]
    assert all(back["model"][k] is tensors[f"/model/{k}"] for k in sd["model"])


def test_a_value_the_skeleton_cannot_describe_is_a_clear_error(tmp_path):
    with pytest.raises(skeleton.Unencodable, match=r"'/meta/dtype' is a torch.dtype.*memory_interval=0"):
        memtier.flatten({"meta": {"dtype": torch.float32}})
    (tmp_path / "mem").mkdir()
    with Checkpointer(str(tmp_path / "ck"), mem_dir=str(tmp_path / "mem")) as ck:
        with pytest.raises(ConfigError, match=r"'/meta/dtype' is a torch.dtype"):  # in the caller's thread
            ck.save(1, {"w": torch.ones(2), "meta": {"dtype": torch.float32}})


@pytest.mark.parametrize("bad", [
    {"__reduce__": ["os.system", "true"]},
    {"tensor": 3},
    {"dict": [[[1], 2]]},  # an unhashable key
    {"dict": [[{"tensor": "/w"}, 1]]},  # a tensor as a key
])
def test_anything_but_ftrts_encoding_is_refused(bad):
    with pytest.raises(skeleton.BadSkeleton):
        skeleton.decode(bad, lambda path: path)


def index(**change) -> dict:
    base = {"step": 4, "round": 1, "rank": 0, "world": 2, "slot": 0, "size": 64,
            "entries": [{"key": "/w", "dtype": "torch.float32", "offset": 0, "nbytes": 16,
                         "local_shape": [2, 2], "global_shape": [4, 2], "global_offset": [0, 0]}],
            "skeleton": {"dict": [["w", {"tensor": "/w"}]]}}
    base.update(change)
    return base


@pytest.mark.parametrize("change,needle", [
    ({"rank": 2}, "outside a world of 2"),
    ({"slot": 64}, "slot 64"),
    ({"step": True}, "step"),
    ({"size": 8}, "does not fit its arena"),
    ({"entries": [{**index()["entries"][0], "dtype": "torch.load"}]}, "not a torch dtype"),
    ({"entries": [{**index()["entries"][0], "global_offset": [3, 0]}]}, "outside its tensor's shape"),
    ({"entries": [{**index()["entries"][0], "nbytes": 12}]}, "does not fit"),
    ({"skeleton": {"dict": [["w", {"tensor": "/other"}]]}}, "no entry for"),
    ({"skeleton": base64.b64encode(planted("/tmp/x")).decode()}, "not ftrt's JSON encoding of a state dict"),
    ({"skeleton": {"dict": [["w", {"set": [1]}]]}}, "not part of ftrt's encoding"),
])
def test_an_index_is_checked_field_by_field(change, needle):
    assert check_index(index()) == index()
    with pytest.raises(BadIndex, match=needle):
        check_index(index(**change))


def test_a_pickle_planted_in_a_memory_index_is_refused_and_never_run(tmp_path, caplog):
    mem, marker = tmp_path / "mem", tmp_path / "pwned"
    mem.mkdir()
    src = make_state()
    with Checkpointer(str(tmp_path / "ck"), mem_dir=str(mem)) as ck:
        ck.save(1, src).wait()  # storage and memory at step 1
        ck.save(2, src, persist=False).wait_staged()  # memory only: newer than storage
    current = mem / "own" / "rank-0" / "current.json"
    idx = json.loads(current.read_text())
    assert idx["step"] == 2
    idx["skeleton"] = base64.b64encode(planted(marker)).decode()  # what an older ftrt kept there
    current.write_text(json.dumps(idx))
    dst = fresh_state()
    with Checkpointer(str(tmp_path / "ck"), mem_dir=str(mem)) as ck, caplog.at_level("WARNING"):
        assert ck.restore(dst) == 1  # the memory checkpoint was refused: storage's step 1
    assert same_params(src["model"], dst["model"])
    assert "ignoring memory checkpoint index" in caplog.text and "held a pickle there" in caplog.text
    assert not marker.exists()


def test_a_replica_carrying_a_pickle_or_a_path_outside_its_folder_is_refused_over_grpc(tmp_path):
    mem, marker = tmp_path / "mem", tmp_path / "pwned"
    mem.mkdir()
    token = JobToken("7" * 64)
    store = MemoryStore()

    def chunk(source: str, idx: dict) -> agent_pb2.ReplicaChunk:
        return agent_pb2.ReplicaChunk(source_node=source, rank=idx["rank"], step=idx["step"],
                                      index_json=json.dumps(idx), data=b"\0" * idx["size"])

    def sha(header: agent_pb2.ReplicaChunk, data: bytes) -> str:
        return hashlib.sha256(header.index_json.encode() + data).hexdigest()

    def trailer(header: agent_pb2.ReplicaChunk, data: bytes) -> agent_pb2.ReplicaChunk:
        return agent_pb2.ReplicaChunk(sha256=sha(header, data))

    async def put(*c: agent_pb2.ReplicaChunk) -> grpc.StatusCode:
        server, port, _ = await replica_server(str(mem), store, token)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                try:
                    await stub.PutReplica(iter(c), metadata=token.metadata())  # a caller with the token
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK
        finally:
            await server.stop(None)

    pickled = index(skeleton=base64.b64encode(planted(marker)).decode())
    assert asyncio.run(put(chunk("peer", pickled))) == grpc.StatusCode.INVALID_ARGUMENT
    for source in ("../../..", "..", "a/b", "peer\n"):
        assert asyncio.run(put(chunk(source, index()))) == grpc.StatusCode.INVALID_ARGUMENT, source
    lying = agent_pb2.ReplicaChunk(source_node="peer", rank=1, step=4, index_json=json.dumps(index()), data=b"\0" * 64)
    assert asyncio.run(put(lying)) == grpc.StatusCode.INVALID_ARGUMENT  # header and index disagree
    too_long = chunk("peer", index())
    too_long.data = b"\0" * 65
    assert asyncio.run(put(too_long)) == grpc.StatusCode.INVALID_ARGUMENT
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == [], written  # nothing stored anywhere, inside the memory folder or out
    good = chunk("peer", index())
    assert asyncio.run(put(good)) == grpc.StatusCode.INVALID_ARGUMENT  # no checksum
    assert asyncio.run(put(good, trailer(good, b"\1" * 64))) == grpc.StatusCode.INVALID_ARGUMENT  # damaged
    assert asyncio.run(put(good, trailer(good, b"\0" * 64))) == grpc.StatusCode.PERMISSION_DENIED  # nobody claimed it
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()] == []

    async def claim() -> None:
        book = await registered(store, "peer")
        await book.publish(0, Claim(step=4, round=1, world=2, size=64, sha256=sha(good, b"\0" * 64)))

    asyncio.run(claim())
    assert asyncio.run(put(good, trailer(good, b"\0" * 64))) == grpc.StatusCode.OK  # its owner's: it goes
    assert memtier.scan(str(mem))[0]["step"] == 4
    assert not marker.exists()


def test_a_pickle_planted_as_dcp_metadata_is_refused_before_it_is_loaded(tmp_path):
    root, marker = tmp_path / "ck", tmp_path / "pwned"
    src = make_state()
    with Checkpointer(str(root)) as ck:
        ck.save(1, src).wait()
        ck.save(2, src).wait()
    (root / step_dir(2) / ".metadata").write_bytes(planted(marker))  # the manifest left as it was
    dst = fresh_state()
    with Checkpointer(str(root)) as ck:
        assert ck.restore(dst) == 1
    assert not marker.exists()
    assert os.path.exists(root / step_dir(2) / "manifest.json")
