"""Log records to journald through its native protocol, with a priority and the job as fields.

Each record is one datagram to journald's socket (`/run/systemd/journal/socket`; DDPD_JOURNAL_SOCKET
names another, as tests do): `KEY=value` lines, or for a value holding a newline the key, a
newline, the value's length as 64-bit little-endian and the value (systemd's "Native Journal
Protocol"). A record carries MESSAGE (the readable line of `logline`), PRIORITY (syslog's: error
3, warning 4, info 6, debug 7), SYSLOG_IDENTIFIER=ddpd, DDPD_EVENT, JOB_ID, ATTEMPT and RANK where
the event is bound to them, and every other field as DDPD_<NAME>; so `journalctl JOB_ID=j12-ab3c
-p warning` finds a job's warnings. No libsystemd is needed.

Sending never blocks the event loop: a full journald queue drops the record (counted in
`dropped`); a socket that is not there (journald gone) sends the record to the fallback stream
as a JSON line instead. Values are clipped (VALUE_LIMIT) and a record is at most RECORD_LIMIT bytes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import structlog

from .logline import message

DEFAULT_SOCKET = Path("/run/systemd/journal/socket")
SOCKET_ENV = "DDPD_JOURNAL_SOCKET"
VALUE_LIMIT = 16 * 1024
RECORD_LIMIT = 96 * 1024
PRIORITIES = {"critical": 2, "error": 3, "exception": 3, "warning": 4, "info": 6, "debug": 7}
_BOUND = {"job_id": "JOB_ID", "attempt": "ATTEMPT", "rank": "RANK"}
_SKIPPED = frozenset({"event", "level", "timestamp", "logger"})
_ESSENTIAL = ("MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "DDPD_EVENT", "JOB_ID", "ATTEMPT", "RANK")
_NOT_NAME = re.compile(r"[^A-Z0-9_]")


def journal_socket() -> Path:
    return Path(os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)


def stream_is_journal(stream: TextIO) -> bool:
    """Whether `stream` is the journal stream systemd connected (JOURNAL_STREAM=dev:inode names it)."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return bool(expected) and not stat.S_ISREG(st.st_mode) and expected == f"{st.st_dev}:{st.st_ino}"


def field_name(key: str) -> str:
    """DDPD_<KEY>: upper case, [A-Z0-9_] only, at most 64 characters (journald's rule)."""
    return ("DDPD_" + _NOT_NAME.sub("_", key.upper()))[:64]


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= VALUE_LIMIT else text[:VALUE_LIMIT - 3] + "..."


def record_fields(event: Mapping[str, Any]) -> dict[str, str]:
    """The journal fields of a structlog event dict."""
    level = str(event.get("level", "info"))
    fields = {"MESSAGE": _text(message(event)), "PRIORITY": str(PRIORITIES.get(level, 6)),
              "SYSLOG_IDENTIFIER": "ddpd", "DDPD_EVENT": _text(event.get("event", ""))}
    for key, value in event.items():
        if value is None or key in _SKIPPED:
            continue
        fields[_BOUND.get(key) or field_name(key)] = _text(value)
    return fields


def encode_record(fields: dict[str, str]) -> bytes:
    """The datagram: KEY=value lines, binary-safe for values with newlines; at most RECORD_LIMIT bytes
    (beyond it only the essential fields are sent)."""
    data = b"".join(_field(k, v) for k, v in fields.items())
    if len(data) > RECORD_LIMIT:
        data = b"".join(_field(k, fields[k]) for k in _ESSENTIAL if k in fields)
    return data


def _field(key: str, value: str) -> bytes:
    raw = value.encode("utf-8", "replace")
    if b"\n" in raw:
        return key.encode() + b"\n" + struct.pack("<Q", len(raw)) + raw + b"\n"
    return key.encode() + b"=" + raw + b"\n"


class JournalLogger:
    """A structlog logger whose records (bytes from `render_record`) go to journald's socket."""

    def __init__(self, path: Path, fallback: TextIO | None = None) -> None:
        self.path = path
        self.fallback = fallback or sys.stderr
        self.dropped = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def msg(self, record: bytes) -> None:
        try:
            self._sock.sendto(record, socket.MSG_DONTWAIT, str(self.path))
        except BlockingIOError:  # journald is behind: drop rather than stall the daemon
            self.dropped += 1
        except OSError as exc:  # no journald there (or the record refused): keep it on the stream
            fields = dict(decode_record(record))
            fields["journal_error"] = str(exc)
            self.fallback.write(json.dumps(fields, default=str) + "\n")
            self.fallback.flush()

    debug = info = warning = warn = error = err = critical = exception = fatal = log = msg

    def close(self) -> None:
        self._sock.close()


def decode_record(record: bytes) -> list[tuple[str, str]]:
    """The fields of a record (for the fallback stream and for tests)."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(record):
        end = record.index(b"\n", i)
        line = record[i:end]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            out.append((key.decode(), value.decode("utf-8", "replace")))
            i = end + 1
        else:
            size = struct.unpack("<Q", record[end + 1:end + 9])[0]
            value = record[end + 9:end + 9 + size]
            out.append((line.decode(), value.decode("utf-8", "replace")))
            i = end + 9 + size + 1
    return out



class JournalLoggerFactory:
    def __init__(self, path: Path, fallback: TextIO | None = None) -> None:
        self.logger = JournalLogger(path, fallback)

    def __call__(self, *args: Any) -> JournalLogger:
        return self.logger


def render_record(logger: Any, method: str, event: structlog.typing.EventDict) -> bytes:
    """A structlog renderer: the event as a journald datagram."""
    return encode_record(record_fields(event))
