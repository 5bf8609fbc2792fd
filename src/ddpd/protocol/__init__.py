"""The protocol: every message type, the framing, the job spec and the state machines.

This package imports nothing else of ddpd; the daemon, the worker and the client meet here.
"""

from __future__ import annotations

from .errors import ErrorCode, RemoteError
from .framing import MAX_DEPTH, MAX_FRAME, MAX_REQUEST, PROTOCOL_VERSION, Decoder, FrameError, LineSplitter, encode
from .spec import BUILTIN_TASKS, DEFAULT_UMASK, JobSpec, SpecError, check_spec, current_umask
from .states import JobState, RankState, TransitionError, check_job_transition, check_rank_transition
from .timeouts import Timeouts
from .worker import RESERVED_ENV, RESERVED_ENV_PREFIXES

__all__ = [
    "BUILTIN_TASKS",
    "DEFAULT_UMASK",
    "MAX_DEPTH",
    "MAX_FRAME",
    "MAX_REQUEST",
    "PROTOCOL_VERSION",
    "RESERVED_ENV",
    "RESERVED_ENV_PREFIXES",
    "Decoder",
    "ErrorCode",
    "FrameError",
    "JobSpec",
    "JobState",
    "LineSplitter",
    "RankState",
    "RemoteError",
    "SpecError",
    "Timeouts",
    "TransitionError",
    "check_job_transition",
    "check_rank_transition",
    "check_spec",
    "current_umask",
    "encode",
]
