"""etcd faults: kill one member of a 3-member cluster, or stop every member, for a while."""

from __future__ import annotations

from ftrt.chaos.faults import Context, Injected


def kill_member(ctx: Context, fault) -> Injected:
    members = ctx.etcd.members
    if fault.target == "random":
        victim = ctx.rng.choice(members)
    elif fault.target == "leader":
        victim = ctx.etcd.leader()
    else:
        victim = next((m for m in members if m.name == fault.target), None)
        if victim is None:
            raise RuntimeError(f"no etcd member named {fault.target!r}")
    victim.kill()
    return Injected(f"etcd:{victim.name}", end=lambda: victim.start(wait=False),
                    detail=f"SIGKILL etcd member {victim.name} for {fault.duration_s} s")


def stop_all(ctx: Context, fault) -> Injected:
    members = getattr(ctx.etcd, "members", [ctx.etcd])
    for m in members:
        m.kill()

    def restart() -> None:
        for m in members:
            m.start(wait=False)

    return Injected("etcd", end=restart, detail=f"SIGKILL every etcd member for {fault.duration_s} s")
