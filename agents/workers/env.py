"""The environment a worker gets: torchrun's variables plus ftrt's, as a pure function.

Any script that runs under torchrun reads the same names here (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...). ``TORCHELASTIC_USE_AGENT_STORE=True`` tells ``init_process_group`` (env://)
to connect to the TCPStore ftrt already runs for the round instead of starting one in rank 0, as
torchrun does with its agent store.
"""

from __future__ import annotations

from ftrt import envnames
from ftrt.records import RoundRecord
from ftrt.roster import LocalRound
from ftrt.store.access import EtcdAccess


def worker_env(
    rnd: LocalRound | RoundRecord,
    *,
    node_id: str,
    local_rank: int,
    job_id: str,
    master_addr: str,
    master_port: int,
    max_restarts: int,
    agent_addr: str,
    etcd: str = "",
    etcd_access: EtcdAccess = EtcdAccess(),
    mtbf: float | None = None,
    checkpoint_key_file: str | None = None,
    error_file: str = "",
    nccl_async_error_handling: str = "1",
    recovery: str = "in-place",
    reconfigure_timeout: float = 10.0,
) -> dict[str, str]:
    """Variables for one worker of ``node_id`` in round ``rnd`` (which must include the node).

    ``etcd_access`` reaches the worker as its ``FTRT_ETCD_*`` variables (file paths, never a
    password: one from ``FTRT_ETCD_PASSWORD`` is inherited with the agent's environment).
    ``error_file``: where a worker whose entry point is wrapped in torchelastic's ``@record``
    writes its exception (``TORCHELASTIC_ERROR_FILE``); ``nccl_async_error_handling``: the
    operator's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, else torchrun's default ``1``; ``recovery`` and
    ``reconfigure_timeout``: ``--recovery`` and ``--reconfigure-timeout``, for a worker that may change
    rounds in place (:mod:`ftrt.control`)."""
    member = rnd.member(node_id)
    if member is None:
        raise ValueError(f"node {node_id!r} is not a member of round {rnd.round}")
    if not 0 <= local_rank < member.nproc:
        raise ValueError(f"local rank {local_rank} is outside 0..{member.nproc - 1}")
    rank = rnd.rank_offset(node_id) + local_rank
    world = rnd.world_size
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(member.nproc),
        "GROUP_RANK": str(rnd.group_rank(node_id)),
        "GROUP_WORLD_SIZE": str(rnd.node_count),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(rnd.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": nccl_async_error_handling,
        **({"TORCHELASTIC_ERROR_FILE": error_file} if error_file else {}),
        envnames.JOB_ID: job_id,
        envnames.NODE_ID: node_id,
        envnames.ROUND: str(rnd.round),
        envnames.AGENT_ADDR: agent_addr,
        envnames.ETCD: etcd,
        # The job's fault history and the operator's expectation, for checkpoint cadence.
        envnames.FAULTS: str(rnd.faults),
        envnames.JOB_STARTED: repr(rnd.job_started or rnd.created),
        envnames.MTBF: "" if mtbf is None else repr(float(mtbf)),
        envnames.RECOVERY: recovery,
        envnames.RECONFIGURE_TIMEOUT: repr(float(reconfigure_timeout)),
        **etcd_access.env(),
        # The path of the checkpoint key, never the key (ftrt.checkpoint.signing); without the flag
        # an operator's own FTRT_CHECKPOINT_KEY(_FILE) reaches the worker with the agent's environment.
        **({envnames.CHECKPOINT_KEY_FILE: checkpoint_key_file} if checkpoint_key_file else {}),
    }


def recorded_error(path) -> str:
    """The first line of the exception a worker wrapped in torchelastic's ``@record`` wrote to its
    ``TORCHELASTIC_ERROR_FILE`` (at most 300 characters), or "" when there is none or it is not one."""
    import json

    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))
        message = data["message"]
        text = message.get("message", "") if isinstance(message, dict) else str(message)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    return str(text).strip().splitlines()[0][:300] if str(text).strip() else ""
