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


def job_env(
    *,
    node_id: str,
    local_rank: int,
    local_world_size: int,
    job_id: str,
    max_restarts: int,
    agent_addr: str,
    etcd: str = "",
    etcd_access: EtcdAccess = EtcdAccess(),
    mtbf: float | None = None,
    checkpoint_key_file: str | None = None,
    nccl_async_error_handling: str = "1",
    recovery: str = "in-place",
    reconfigure_timeout: float = 10.0,
    min_nodes: int = 1,
) -> dict[str, str]:
    """The variables of one worker that do not depend on its round: the job, the node, its place on
    the node (``LOCAL_RANK``), the agent and etcd, and the operator's settings. A worker started
    before its node is admitted (:func:`pending_env`) has only these.

    ``etcd_access`` reaches the worker as its ``FTRT_ETCD_*`` variables (file paths, never a
    password: one from ``FTRT_ETCD_PASSWORD`` is inherited with the agent's environment).
    ``nccl_async_error_handling``: the operator's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, else
    torchrun's default ``1``; ``recovery`` and ``reconfigure_timeout``: ``--recovery`` and
    ``--reconfigure-timeout``, for a worker that may change rounds in place (:mod:`ftrt.control`);
    ``min_nodes``: ``--nnodes MIN``."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is outside 0..{local_world_size - 1}")
    return {
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "ROLE_NAME": "default",
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": nccl_async_error_handling,
        envnames.JOB_ID: job_id,
        envnames.NODE_ID: node_id,
        envnames.AGENT_ADDR: agent_addr,
        envnames.ETCD: etcd,
        envnames.MTBF: "" if mtbf is None else repr(float(mtbf)),
        envnames.RECOVERY: recovery,
        envnames.MIN_NODES: str(min_nodes),
        envnames.RECONFIGURE_TIMEOUT: repr(float(reconfigure_timeout)),
        **etcd_access.env(),
        # The path of the checkpoint key, never the key (ftrt.checkpoint.signing); without the flag
        # an operator's own FTRT_CHECKPOINT_KEY(_FILE) reaches the worker with the agent's environment.
        **({envnames.CHECKPOINT_KEY_FILE: checkpoint_key_file} if checkpoint_key_file else {}),
    }


def pending_env(**job) -> dict[str, str]:
    """Variables for a worker started before its node is admitted to a running job whose workers
    change rounds in place (:func:`job_env`'s keywords): it runs its script up to
    :meth:`ftrt.Runtime.init_process_group` (imports, model, compilation), and its round, rank and
    world come later as a :class:`ftrt.control.NewRound` (:func:`worker_env`). The round's variables
    are blank (round 0): ones the agent's own environment carries (it may run inside another job)
    must not pass for this worker's round, nor hide the round that admits it."""
    return {**job_env(**job), **dict.fromkeys(ROUND_VARIABLES, ""), envnames.ROUND: "0",
            envnames.ADMISSION: "pending"}


ROUND_VARIABLES = ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
                   "MASTER_ADDR", "MASTER_PORT")
"""torchrun's variables that :func:`worker_env` sets for a round (blank before admission)."""


def worker_env(
    rnd: LocalRound | RoundRecord,
    *,
    master_addr: str,
    master_port: int,
    error_file: str = "",
    **job,
) -> dict[str, str]:
    """Variables for one worker of ``job["node_id"]`` in round ``rnd`` (which must include the
    node): torchrun's and ftrt's for the round, on top of :func:`job_env` (its keywords; the round's
    member gives ``local_world_size``). ``error_file``: where a worker whose entry
    point is wrapped in torchelastic's ``@record`` writes its exception (``TORCHELASTIC_ERROR_FILE``)."""
    node_id, local_rank = job["node_id"], job["local_rank"]
    member = rnd.member(node_id)
    if member is None:
        raise ValueError(f"node {node_id!r} is not a member of round {rnd.round}")
    base = job_env(**{**job, "local_world_size": member.nproc})
    rank = rnd.rank_offset(node_id) + local_rank
    world = rnd.world_size
    return {
        **base,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "GROUP_RANK": str(rnd.group_rank(node_id)),
        "GROUP_WORLD_SIZE": str(rnd.node_count),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(rnd.restart_count),
        **({"TORCHELASTIC_ERROR_FILE": error_file} if error_file else {}),
        envnames.ROUND: str(rnd.round),
        # The job's fault history and the operator's expectation, for checkpoint cadence.
        envnames.FAULTS: str(rnd.faults),
        envnames.JOB_STARTED: repr(rnd.job_started or rnd.created),
        envnames.ADMISSION: "",  # admitted (a worker started before its node was admitted reads it again)
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
