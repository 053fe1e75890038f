"""What must hold after a chaos run: one pure function per invariant, each ``-> (ok, reason)``.

Each judges facts the runner gathered (rank 0's metrics lines, the fault records, the agents'
exit codes, the processes and leased keys left, the checkpoints found in storage), so that each
can be tested on small hand-made inputs. :func:`judge` applies them all to one run:

- ``final_step``: every step 0..steps-1 was trained, the job exited 0;
- ``recovered``: every fault's recovery (the runner's ``recovery_time``: to the end of the step
  closing the longest stall after it) is within ``expect.max_recovery_s`` (a cold fault's within
  ``expect.max_cold_recovery_s``: see :func:`recovery_limit`);
- ``checkpoints_verify``: every committed checkpoint verifies, except the ones a fault damaged
  on purpose (those must fail verification);
- ``ledger``: the trained prompts have no gap and no repeat;
- ``equivalence``: per ``expect.equivalence`` (``exact``: a fault-free run of the same job is run
  first and every step's metrics must match it bit for bit; ``ledger``: each step trained the
  same prompts as a fault-free run does);
- ``world_grows`` (``expect.world_grows``): the world grew again after its smallest size;
- ``metrics_agree`` (one ``kill_node`` or ``kill_worker`` fault): each agent that saw the
  recovery reports it in ``ftrt_recovery_seconds`` within 0.5 s + 25 % of the time measured
  from the steps;
- ``trainer_untouched`` (faults of the rollout fleet only): no trainer process was restarted
  (the metrics count no resume);
- ``nothing_redone`` (planned departures only: ``drain_node``, ``preempt_node``): the job redid no
  step (the trainer's ``redone`` counter is 0 at the end);
- ``no_process_left``: no process the run started is still alive;
- ``no_stale_keys``: no key under the job's etcd prefix is still attached to a lease.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ftrt.chaos.scenario import Scenario

if TYPE_CHECKING:
    from ftrt.chaos.runner import FaultRecord, JobResult

Verdict = tuple[bool, str]
"""Whether an invariant holds, and why (a sentence for the report)."""

EXACT_FIELDS = ("step", "reward_mean", "loss", "kl", "grad_norm", "world_size", "prompt_ids")
"""The fields of a metrics line that ``equivalence: exact`` compares."""
CHECKED_BY_METRICS = ("kill_node", "kill_worker")
"""Faults whose first evidence an agent sees at once (a broken stream, an exit), so that its
``ftrt_recovery_seconds`` and the report's recovery time measure the same span."""


@dataclass(frozen=True)
class CheckpointScan:
    """The checkpoints found in a job's storage at the end of a run."""

    url: str
    verified: dict[int, str | None] = field(default_factory=dict)
    """Each committed step -> why its files fail verification (None: they verify)."""
    damaged: frozenset[int] = frozenset()
    """The steps a fault damaged on purpose."""
    listing_error: str | None = None
    """Why the storage could not be listed (then nothing else is known)."""


def recovery_limit(sc: Scenario, spares_warm: bool) -> float:
    """The recovery a fault is judged against: ``expect.max_recovery_s``, or for a cold fault (some
    agent's spares still warming) ``expect.max_cold_recovery_s`` (default the larger of it and 30 s)."""
    if spares_warm:
        return sc.expect.max_recovery_s
    cold = sc.expect.max_cold_recovery_s
    return cold if cold is not None else max(sc.expect.max_recovery_s, 30.0)


def injected(records: list[FaultRecord]) -> list[FaultRecord]:
    """The faults that were injected (not those that could not be, or were never due)."""
    return [r for r in records if not r.detail.startswith("not injected")]


def world_sizes(lines: list[dict]) -> list[int]:
    """The world sizes the job trained at, in order, each change once."""
    worlds: list[int] = []
    for x in lines:
        if not worlds or worlds[-1] != x["world_size"]:
            worlds.append(x["world_size"])
    return worlds


def final_step(steps: int, lines: list[dict], codes: dict[str, int | None]) -> Verdict:
    """Every step 0..``steps``-1 has one metrics line, and every agent still there exited 0 (a
    SIGKILLed agent that was not restarted cannot, and is not in ``codes``)."""
    trained = [x["step"] for x in lines]
    if trained == list(range(steps)):
        return all(c == 0 for c in codes.values()), f"steps 0..{steps - 1} trained once each, agents exited {codes}"
    return False, f"trained steps {_ranges(trained)} of 0..{steps - 1}; agents exited {codes}"


def recovered(sc: Scenario, records: list[FaultRecord]) -> Verdict:
    """Every fault was injected, and each one's recovery is within its limit (``limit_s``, else
    ``expect.max_recovery_s``)."""
    late = [r for r in records if r.recovery_s is None or r.recovery_s > (r.limit_s or sc.expect.max_recovery_s)]
    done = injected(records)
    cold = [r for r in done if not r.spares_warm]
    return (not late and len(done) == len(records),
            f"{len(done)}/{len(records)} faults injected; slowest recovery "
            f"{max((r.recovery_s or 0) for r in records) if records else 0:.2f} s "
            f"(limit {sc.expect.max_recovery_s} s"
            + (f"; {len(cold)} cold, limit {recovery_limit(sc, False)} s" if cold else "") + ")"
            + (f"; late: {[r.kind for r in late]}" if late else ""))


def checkpoints_verify(scan: CheckpointScan | None) -> Verdict:
    """At least one committed checkpoint, every one verifies but those damaged on purpose, which
    must not."""
    if scan is None:
        return False, "not checked"
    if scan.listing_error is not None:
        return False, f"cannot list the checkpoints at {scan.url}: {scan.listing_error}"
    good, bad, unexpected = 0, [], []
    for step, error in scan.verified.items():
        if error is None:
            if step in scan.damaged:
                unexpected.append(f"step {step} was damaged but verifies")
            good += 1
        else:
            (bad if step in scan.damaged else unexpected).append(f"step {step}: {error}")
    if unexpected:
        return False, "; ".join(unexpected)
    if not good:
        return False, f"no committed checkpoint at {scan.url}"
    return True, f"{good} committed checkpoints verify" + (f"; {len(bad)} damaged on purpose fail as they must" if bad else "")


def ledger(lines: list[dict], prompts_per_step: int) -> Verdict:
    """The prompts trained are exactly 0..(steps x ``prompts_per_step``)-1: none missing, none twice."""
    trained = [i for x in lines for i in x["prompt_ids"]]
    return (sorted(trained) == list(range(len(lines) * prompts_per_step)) and len(set(trained)) == len(trained),
            f"{len(trained)} prompts, {len(trained) - len(set(trained))} repeated, "
            f"{len(set(range(len(lines) * prompts_per_step)) - set(trained))} missing")


def same_metrics(lines: list[dict], reference: list[dict]) -> Verdict:
    """``equivalence: exact``: every step's :data:`EXACT_FIELDS` equal the fault-free run's, bit for bit."""
    diff = [a["step"] for a, b in zip(lines, reference)
            if {k: a.get(k) for k in EXACT_FIELDS} != {k: b.get(k) for k in EXACT_FIELDS}]
    return (not diff and len(lines) == len(reference),
            "every step's reward, loss, kl, gradient norm and prompts equal the fault-free run's" if not diff
            else f"steps {diff[:10]} differ from the fault-free run")


def same_prompts(lines: list[dict], prompts_per_step: int) -> Verdict:
    """``equivalence: ledger``: step ``s`` trained prompts ``[s P, (s + 1) P)``, as a fault-free run does."""
    wrong = [x["step"] for x in lines
             if x["prompt_ids"] != list(range(x["step"] * prompts_per_step, (x["step"] + 1) * prompts_per_step))]
    return not wrong, ("each step trained the fault-free run's prompts" if not wrong
                       else f"steps {wrong[:10]} trained other prompts")


def world_grows(worlds: list[int]) -> Verdict:
    """The world grew again after its smallest size (a node joined or came back)."""
    low = worlds.index(min(worlds)) if worlds else 0
    grew = bool(worlds) and max(worlds[low:]) > worlds[low]
    return grew, (f"world sizes {' -> '.join(map(str, worlds))}: "
                  + ("it grew again after its smallest" if grew else "it never grew after its smallest"))


def metrics_agree(injected: list[FaultRecord], scraped: dict[str, dict]) -> Verdict | None:
    """Whether the agents' ``ftrt_recovery_seconds`` matches the report's recovery time, for a run
    with one fault of a kind agents see at once (None: nothing to compare)."""
    if len(injected) != 1 or injected[0].kind not in CHECKED_BY_METRICS or injected[0].recovery_s is None:
        return None
    if not scraped:  # no agent serves metrics here (network namespaces): nothing to compare
        return None
    seen = {n: m["recovery_sum_s"] / m["recovery_count"] for n, m in scraped.items() if m["recovery_count"] == 1}
    if not seen:
        return False, f"no agent's ftrt_recovery_seconds observed the {injected[0].kind} (scraped: {scraped})"
    measured = injected[0].recovery_s
    worst = max(seen.values(), key=lambda v: abs(v - measured))
    ok = abs(worst - measured) <= 0.5 + 0.25 * measured
    return ok, (f"ftrt_recovery_seconds on {', '.join(f'{n} {v:.2f} s' for n, v in sorted(seen.items()))} against "
                f"{measured:.2f} s measured from the steps (allowed: 0.5 s + 25 %)")


def no_process_left(alive: list[int]) -> Verdict:
    """None of the run's processes is alive (``alive``: the pids still running)."""
    return not alive, "no process of the run is alive" if not alive else f"still alive: {alive}"


def no_stale_keys(stale: list[str]) -> Verdict:
    """No key under the job's prefix is still attached to a lease (``stale``: those that are)."""
    return not stale, "no leased key left under the job's prefix" if not stale else f"leased keys left: {stale}"


def _rollout_only(records: list[FaultRecord]) -> bool:
    from ftrt.chaos.scenario import ROLLOUT_KINDS

    done = injected(records)
    return bool(done) and all(r.kind in ROLLOUT_KINDS for r in done)


def _planned_only(records: list[FaultRecord]) -> bool:
    from ftrt.chaos.scenario import PLANNED_KINDS

    done = injected(records)
    return bool(done) and all(r.kind in PLANNED_KINDS for r in done)


def nothing_redone(lines: list[dict]) -> Verdict:
    """No step was trained twice: the last metrics line's ``redone`` counter is 0."""
    redone = lines[-1].get("redone", 0) if lines else 0
    return redone == 0, ("no step was redone" if redone == 0 else f"{redone} step(s) were trained again")


def trainer_untouched(lines: list[dict]) -> Verdict:
    """No trainer process restarted: the last metrics line counts no resume."""
    resumes = lines[-1].get("resumes", 0) if lines else 0
    return resumes == 0, ("no trainer process was restarted" if resumes == 0
                          else f"the trainer resumed {resumes} time(s) from a checkpoint")


def judge(sc: Scenario, job: JobResult, reference: list[dict] | None, alive: list[int]) -> dict[str, dict]:
    """Every invariant that applies to the run ``job`` of ``sc``, in the report's order, as
    ``{name: {"ok": ..., "reason": ...}}``. ``reference``: the fault-free run's metrics lines
    (``equivalence: exact``); ``alive``: the run's processes still alive."""
    lines = job.lines
    per = int(sc.job.grpo.get("prompts_per_step", 32))
    verdicts: dict[str, Verdict | None] = {
        "final_step": final_step(sc.steps, lines, job.codes),
        "recovered": recovered(sc, job.records),
        "checkpoints_verify": checkpoints_verify(job.checkpoints),
        "ledger": ledger(lines, per),
        "equivalence": (same_metrics(lines, reference or []) if sc.expect.equivalence == "exact"
                        else same_prompts(lines, per) if sc.expect.equivalence == "ledger" else None),
        "world_grows": world_grows(world_sizes(lines)) if sc.expect.world_grows else None,
        "metrics_agree": metrics_agree(injected(job.records), job.scraped),
        "trainer_untouched": trainer_untouched(lines) if _rollout_only(job.records) else None,
        "nothing_redone": nothing_redone(lines) if _planned_only(job.records) else None,
        "no_process_left": no_process_left(alive),
        "no_stale_keys": no_stale_keys(job.stale),
    }
    return {name: {"ok": bool(v[0]), "reason": v[1]} for name, v in verdicts.items() if v is not None}


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{min(steps)}..{max(steps)} ({len(steps)} lines, {len(set(steps))} distinct)"
