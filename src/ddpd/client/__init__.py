"""Python API of ddpd's control socket: `AsyncClient` (AnyIO) and the blocking `Client` over it.

Error replies raise `RemoteError(code, message)`; a socket that cannot be reached raises
`DaemonUnavailable` (`UnsafeSocket` when the default socket's directory belongs to another user),
and a daemon that hangs up mid-reply `ConnectionLost`.
"""

from __future__ import annotations

from ddpd.protocol import (
    BUILTIN_TASKS,
    ErrorCode,
    JobSpec,
    JobState,
    RankState,
    RemoteError,
    SpecError,
    Timeouts,
    check_spec,
    current_umask,
)
from ddpd.protocol.control import (
    CancelResult,
    CurvePoint,
    CurveResult,
    DaemonInfo,
    EventView,
    GpuReleaseResult,
    GpuView,
    JobPage,
    JobView,
    LogChunk,
    PoolServerView,
    RankGpu,
    RankStacks,
    RankView,
    Reply,
    Request,
    RootCause,
    ShareResult,
    ShareView,
    StackGroup,
    StacksResult,
    SubmitResult,
    WhoAmI,
)
from ddpd.protocol.logquery import MAX_TAIL, QueryError, format_stamp, parse_rank_set, parse_since
from ddpd.protocol.logquery import Stream as LogStream
from ddpd.protocol.nodes import NodeView, local_ranks, span_text
from ddpd.protocol.spec import MAX_WORLD

from .aio import AsyncClient, AsyncConnection, AsyncStream
from .blocking import Client, Connection, Stream
from .errors import ConnectionLost, DaemonUnavailable, ProtocolError, UnsafeSocket
from .wire import build_spec

__all__ = [
    "BUILTIN_TASKS",
    "MAX_TAIL",
    "MAX_WORLD",
    "AsyncClient",
    "AsyncConnection",
    "AsyncStream",
    "CancelResult",
    "Client",
    "Connection",
    "ConnectionLost",
    "CurvePoint",
    "CurveResult",
    "DaemonInfo",
    "DaemonUnavailable",
    "ErrorCode",
    "EventView",
    "GpuReleaseResult",
    "GpuView",
    "JobPage",
    "JobSpec",
    "JobState",
    "JobView",
    "LogChunk",
    "LogStream",
    "NodeView",
    "PoolServerView",
    "ProtocolError",
    "QueryError",
    "RankGpu",
    "RankStacks",
    "RankState",
    "RankView",
    "RemoteError",
    "Reply",
    "Request",
    "RootCause",
    "ShareResult",
    "ShareView",
    "SpecError",
    "StackGroup",
    "StacksResult",
    "Stream",
    "SubmitResult",
    "Timeouts",
    "UnsafeSocket",
    "WhoAmI",
    "build_spec",
    "check_spec",
    "current_umask",
    "format_stamp",
    "local_ranks",
    "parse_rank_set",
    "parse_since",
    "span_text",
]
