"""Storage faults: the S3 endpoint goes away (an outage) or slows down, for a while.

Needs the scenario's ``cluster.storage: s3``: checkpoints go to moto's S3 server through a
:class:`ftrt.chaos.proxy.TcpProxy`, so an outage refuses and drops every connection and a
slowdown delays every chunk, without touching the stored objects. Saves during an outage fail
(nothing is committed) and training goes on; the first save after it commits again.
"""

from __future__ import annotations

from ftrt.chaos.faults import Context, Injected


def _proxy(ctx: Context, kind: str):
    if ctx.storage_proxy is None:
        raise RuntimeError(f"{kind} needs checkpoints on S3 (cluster.storage: s3)")
    return ctx.storage_proxy


def outage(ctx: Context, fault) -> Injected:
    proxy = _proxy(ctx, "storage_outage")
    proxy.cut()
    return Injected("s3", end=proxy.restore, detail=f"every S3 connection refused for {fault.duration_s} s")


def slow(ctx: Context, fault) -> Injected:
    proxy = _proxy(ctx, "storage_slow")
    proxy.slow(fault.delay_s)
    return Injected("s3", end=proxy.restore,
                    detail=f"+{fault.delay_s} s on every 64 KiB S3 chunk for {fault.duration_s} s")
