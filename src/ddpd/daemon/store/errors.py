"""Errors the scheduler and the journal raise for a client's request; each carries its stable code.

The control server answers any `DaemonError` as `Error(code=exc.code, message=exc.message)`.
"""

from __future__ import annotations

from typing import ClassVar

from ...protocol import ErrorCode


class DaemonError(Exception):
    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StorageError(DaemonError):
    """The state database cannot be written (locked, disk full, read-only): no new work is taken."""

    code = ErrorCode.STORAGE_UNAVAILABLE


class LimitError(DaemonError):
    """A queue limit of the daemon (per user or in all) is reached."""

    code = ErrorCode.LIMIT_EXCEEDED


class NotRunnableError(DaemonError):
    """The job is in a state that does not allow the request (for example `rm` of a running job)."""

    code = ErrorCode.NOT_RUNNABLE


class ForbiddenError(DaemonError, PermissionError):
    """Only the job's owner or root may do this."""

    code = ErrorCode.PERMISSION_DENIED
