"""Errors of the data side of the workload: what was expected, where, and how to fix it."""

from __future__ import annotations

__all__ = ["ChecksumError", "DataError"]


class DataError(ValueError):
    """Missing or malformed data; the message says what was expected and where."""


class ChecksumError(DataError):
    """A file's digest does not match the expected one."""
