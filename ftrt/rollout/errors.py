"""Errors an engine raises while serving (the server maps them to gRPC status codes)."""

from __future__ import annotations

from ftrt.errors import FtrtError


class EngineFailed(FtrtError):
    """The engine (e.g. the vLLM server behind it) did not answer as it should: down, refused, too slow."""


class StaleVersion(FtrtError):
    """The engine moved to another weight version before this group started."""
