"""The coordination store: a small protocol over etcd's v3 API, its etcd and in-memory
implementations, and local etcd servers for tests and single-machine jobs."""

from ftrt.store.api import (
    Compare,
    Delete,
    Get,
    KeyValue,
    Lease,
    Put,
    Store,
    TxnResult,
    WatchEvent,
)

__all__ = [
    "Compare",
    "Delete",
    "Get",
    "KeyValue",
    "Lease",
    "Put",
    "Store",
    "TxnResult",
    "WatchEvent",
]
