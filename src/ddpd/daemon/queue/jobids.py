"""Job ids as people type them: the whole id, `j12` for job number 12, or a prefix with its dash.

Ids are made `j<seq>-<4 hex digits>` (`j12-ab3c`). `resolve` is the one place a job id a client
sent becomes a job, for every request that names one (and for `--after`):
- the exact id;
- `j<digits>` names the job of that number and nothing else: `j3` is j3-..., never j30-...; once
  j3 is removed, `j3` is "no job" (never a longer number, never "ambiguous");
- text holding the dash (`j12-a`) matches the ids that start with it; several is an error listing
  some of them (at most MAX_CANDIDATES), never a guess.
Anything else names no job.
"""

from __future__ import annotations

import re

from ...protocol import ErrorCode
from ..store.errors import DaemonError, NotFoundError
from ..store.records import Job
from .table import JobTable

MAX_CANDIDATES = 10  # ids listed in an ambiguous-prefix error
_NUMBER = re.compile(r"^j(\d{1,19})$")
_ID_TEXT = re.compile(r"^[A-Za-z0-9_.-]+$")  # what an id can hold: anything else names no job


class UnknownJobError(NotFoundError):
    """No job has that id (or prefix)."""


class AmbiguousJobError(DaemonError):
    code = ErrorCode.AMBIGUOUS

    def __init__(self, text: str, candidates: list[str], more: bool) -> None:
        listed = ", ".join(candidates) + (", ..." if more else "")
        super().__init__(f"{text!r} is the start of more than one job id ({listed}); give more of the id")
        self.candidates = candidates


def prefix_of(text: str) -> str | None:
    """The id prefix `text` stands for: `j<N>-` for a job number, the text itself when it holds the
    dash, else None (it names no job unless it is a whole id)."""
    number = _NUMBER.fullmatch(text)
    if number is not None:
        return f"j{int(number.group(1))}-"
    return text if "-" in text else None


async def resolve(table: JobTable, text: str) -> Job:
    """The job `text` names; UnknownJobError or AmbiguousJobError (codes not_found, ambiguous)."""
    if not _ID_TEXT.fullmatch(text):
        raise UnknownJobError(f"no job {text!r}")
    job = await table.lookup(text)
    if job is not None:
        return job
    prefix = prefix_of(text)
    ids = [] if prefix is None else await table.journal.ids_with_prefix(prefix, MAX_CANDIDATES + 1)
    if len(ids) == 1 and (job := await table.lookup(ids[0])) is not None:
        return job
    if len(ids) > 1:
        raise AmbiguousJobError(text, ids[:MAX_CANDIDATES], len(ids) > MAX_CANDIDATES)
    raise UnknownJobError(f"no job {text!r}")
