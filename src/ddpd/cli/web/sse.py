"""Server-sent events as the pages read them: `replace` (an element's new content), `append` (rows to
add to an element), `end` (the stream is over: the page closes it instead of reconnecting).

Each message's data is one line of JSON ({"id", "html"}), so no text of a job can break the framing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.responses import StreamingResponse

HEADERS = {"cache-control": "no-store", "x-accel-buffering": "no"}


def message(event: str, data: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


def replace(element: str, html: str) -> bytes:
    return message("replace", {"id": element, "html": html})


def append(element: str, html: str) -> bytes:
    return message("append", {"id": element, "html": html})


def end(reason: str) -> bytes:
    return message("end", {"reason": reason})


def response(stream: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers=HEADERS)
