"""Stable error codes of the control protocol."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    MALFORMED_FRAME = "malformed_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    BAD_MESSAGE = "bad_message"
    UNKNOWN_OPERATION = "unknown_operation"
    VERSION_MISMATCH = "version_mismatch"
    BAD_SPEC = "bad_spec"
    NOT_FOUND = "not_found"
    OTHER_NODE = "other_node"  # a rank of a multi-node job that runs on another node: ask its daemon
    AMBIGUOUS = "ambiguous"  # a job id prefix that more than one job has
    PERMISSION_DENIED = "permission_denied"
    NOT_RUNNABLE = "not_runnable"
    SHUTTING_DOWN = "shutting_down"
    LIMIT_EXCEEDED = "limit_exceeded"  # a queue, connection or size limit of the daemon
    STORAGE_UNAVAILABLE = "storage_unavailable"  # the state database cannot be written: no new work
    BAD_CONFIG = "bad_config"  # a reload found a bad config file; the running config stays
    TIMEOUT = "timeout"  # a connection idle, or a request frame incomplete, for too long
    INTERNAL = "internal"


class RemoteError(Exception):
    """An error reply from the daemon, raised on the client side."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
