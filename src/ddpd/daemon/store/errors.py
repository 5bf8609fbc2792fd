"""The daemon's one error model: every expected failure of a request is a `DaemonError` with its code.

The control server answers any `DaemonError` as `Error(code=exc.code, message=exc.message)`; any
other exception met while serving a request is a bug, answered `internal`. Failures of other
layers that a client caused (a bad spec, a bad config file on reload) become their `DaemonError`
where the request is handled.
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
    """The caller may not do this (only the job's owner or root may; a per-user daemon serves its user)."""

    code = ErrorCode.PERMISSION_DENIED


class NotFoundError(DaemonError):
    """What the request names does not exist (a job's rank, for example)."""

    code = ErrorCode.NOT_FOUND


class OtherNodeError(DaemonError):
    """A rank of a multi-node job that runs on another node (the message names it and its daemon)."""

    code = ErrorCode.OTHER_NODE


class VersionMismatchError(DaemonError):
    """The client speaks another protocol version."""

    code = ErrorCode.VERSION_MISMATCH


class ShuttingDownError(DaemonError):
    """The daemon is stopping and takes no new work."""

    code = ErrorCode.SHUTTING_DOWN


class BadSpecError(DaemonError):
    """A job spec that cannot run (a `SpecError` as the client sees it: `field: problem`)."""

    code = ErrorCode.BAD_SPEC


class BadConfigError(DaemonError):
    """A reload found a bad config file; the running config stays."""

    code = ErrorCode.BAD_CONFIG
