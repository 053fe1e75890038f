"""Every ``FTRT_*`` environment variable, in one place: the contract between an agent, its
workers and spares, and the operator.

Code reads and writes these names only through this module, so a name cannot drift between the
side that sets it and the side that reads it. Pure constants: workers import it at start-up.
"""

from __future__ import annotations

# -- agent -> worker: who and where the worker is (agents/workers/env.py sets them per round) -----
JOB_ID = "FTRT_JOB_ID"
"""The job's id; its presence means the process runs under ``ftrt launch``."""
NODE_ID = "FTRT_NODE_ID"
ROUND = "FTRT_ROUND"
"""The rendezvous round the worker runs in."""
AGENT_ADDR = "FTRT_AGENT_ADDR"
"""``host:port`` of the node agent's gRPC service."""
ETCD = "FTRT_ETCD"
"""The job's etcd endpoints (the checkpoint pointer uses them)."""
FAULTS = "FTRT_FAULTS"
"""Faults the job has had so far (for checkpoint cadence)."""
JOB_STARTED = "FTRT_JOB_STARTED"
"""Wall time the job's first round started."""
MTBF = "FTRT_MTBF"
"""The operator's ``--mtbf`` (seconds), or empty."""
MEM_DIR = "FTRT_MEM_DIR"
"""The node's memory-tier directory."""
MIN_NODES = "FTRT_MIN_NODES"
"""The fewest nodes the job runs with (``ftrt launch --nnodes MIN``): a round of that many nodes
that loses one goes inactive, and its workers stop."""
RECOVERY = "FTRT_RECOVERY"
"""``in-place`` or ``restart`` (``ftrt launch --recovery``): whether a worker that asks may change
rounds without exiting."""
RECONFIGURE_TIMEOUT = "FTRT_RECONFIGURE_TIMEOUT"
"""Seconds a worker in place waits for its next round after a collective failed (``--reconfigure-timeout``)."""
ADMISSION = "FTRT_ADMISSION"
"""``pending``: the worker was started before its node was admitted to a running job (its node joins
a job whose workers change rounds in place): it warms up, and its first round reaches it over its
control pipe when :meth:`ftrt.Runtime.init_process_group` waits for it."""
ROUND_END_FILE = "FTRT_ROUND_END_FILE"
"""The mapped file through which the agent asks a round to end at a step boundary."""

# -- agent -> spare (agents/workers/pool.py, agents/workers/_bootstrap.py, agents/workers/template.py) ----------------
CONTROL_FD = "FTRT_CONTROL_FD"
"""The pipe on which a spare receives its assignment, and a worker in place its next rounds (:mod:`ftrt.control`)."""
REPORT_FD = "FTRT_REPORT_FD"
"""The pipe on which a worker reports heartbeats, checkpoints and readiness to its agent."""
FENCE_FILE = "FTRT_FENCE_FILE"
"""The agent's fence file: a worker stops when its lease deadline passes."""
WARM_STORE = "FTRT_WARM_STORE"
"""``1``: the spare pre-starts the round's TCPStore (it may become rank 0)."""
WARM_IMPORTS = "FTRT_WARM_IMPORTS"
"""Comma-separated modules a spare imports while it waits."""
WARM_IDLE = "FTRT_WARM_IDLE"
"""``1``: the spare warms at idle CPU priority."""
AGENT_PID = "FTRT_AGENT_PID"
"""The agent's pid: a spare dies with it."""
TEMPLATE_FD = "FTRT_TEMPLATE_FD"
"""The socket on which a spare template takes fork requests."""

# -- the operator's (and, for secrets, handed down as file paths) ---------------------------------
ETCD_BIN = "FTRT_ETCD_BIN"
"""The etcd binary for ``--standalone``, ``ftrt etcd`` and tests."""
ETCD_CACERT = "FTRT_ETCD_CACERT"
ETCD_CERT = "FTRT_ETCD_CERT"
ETCD_KEY = "FTRT_ETCD_KEY"
ETCD_USER = "FTRT_ETCD_USER"
ETCD_PASSWORD = "FTRT_ETCD_PASSWORD"
"""etcd user's password (never on a command line)."""
ETCD_PASSWORD_FILE = "FTRT_ETCD_PASSWORD_FILE"
ETCD_TLS = "FTRT_ETCD_TLS"
"""``1``: TLS to etcd with the system's CA roots when no CA file is given."""
STATE_DIR = "FTRT_STATE_DIR"
"""Where ftrt keeps this user's state on the host: the credentials of the etcds it started
(default ``$XDG_STATE_HOME/ftrt``, else ``~/.local/state/ftrt``; :mod:`ftrt.store.localetcd`)."""
CHECKPOINT_KEY = "FTRT_CHECKPOINT_KEY"
"""The job's checkpoint key itself (an operator's alternative to the key file)."""
CHECKPOINT_KEY_FILE = "FTRT_CHECKPOINT_KEY_FILE"
"""The path of the job's checkpoint key (what an agent hands its workers)."""
DIAG_OFF = "FTRT_DIAG_OFF"
"""Comma-separated components to switch off, for measurements (:mod:`ftrt._diag`)."""
DIAG_TRACE = "FTRT_DIAG_TRACE"
"""A file to which workers append timing marks (:mod:`ftrt._diag`)."""
DIAG_HOLD = "FTRT_DIAG_HOLD"
"""``POINT:STEP``: the worker waits at that point of that step for the next round (:mod:`ftrt._diag`, tests)."""
DIAG_CRASH = "FTRT_DIAG_CRASH"
"""``POINT:STEP:RANK:MARKER``: that rank exits at that point of that step, once (:mod:`ftrt._diag`, tests)."""

# -- Ray node host -> its workers (ftrt.integrations.ray) ---------------------------------------
RAY_HOST_SOCKET = "FTRT_RAY_HOST_SOCKET"
"""The node host's Unix socket, where each worker of an elastic Ray group takes its calls."""
RAY_HOST_KEY = "FTRT_RAY_HOST_KEY"
"""The key (hex) a worker proves it holds before the host hears anything from it."""
