"""Job ids as people type them: the whole id, `j12` for job number 12, or any unique prefix.

Ids are made `j<seq>-<4 hex digits>` (`j12-ab3c`). `resolve` is the one place a job id a client
sent becomes a job, for every request that names one (and for `--after`): the exact id first;
then `j<digits>` as the job of that number (so `j1` is j1-..., not j10-... too); then any prefix
that only one job's id has. A prefix that several ids have is an error listing some of them
(at most MAX_CANDIDATES), never a guess.
"""

from __future__ import annotations

import re

from ...protocol import ErrorCode
from ..store.errors import DaemonError
from ..store.records import Job
from .table import JobTable

MAX_CANDIDATES = 10  # ids listed in an ambiguous-prefix error
_NUMBER = re.compile(r"^j(\d{1,19})$")
_ID_TEXT = re.compile(r"^[A-Za-z0-9_.-]+$")  # what an id can hold: anything else names no job


class UnknownJobError(DaemonError):
    code = ErrorCode.NOT_FOUND


class AmbiguousJobError(DaemonError):
    code = ErrorCode.AMBIGUOUS

    def __init__(self, text: str, candidates: list[str], more: bool) -> None:
        listed = ", ".join(candidates) + (", ..." if more else "")
        super().__init__(f"{text!r} is the start of more than one job id ({listed}); give more of the id")
        self.candidates = candidates


async def resolve(table: JobTable, text: str) -> Job:
    """The job `text` names; UnknownJobError or AmbiguousJobError (codes not_found, ambiguous)."""
    if not _ID_TEXT.fullmatch(text):
        raise UnknownJobError(f"no job {text!r}")
    job = await table.lookup(text)
    if job is not None:
        return job
    number = _NUMBER.fullmatch(text)
    if number is not None:
        ids = await table.journal.ids_with_prefix(f"j{int(number.group(1))}-", 2)
        if len(ids) == 1 and (job := await table.lookup(ids[0])) is not None:
            return job
    ids = await table.journal.ids_with_prefix(text, MAX_CANDIDATES + 1)
    if len(ids) == 1 and (job := await table.lookup(ids[0])) is not None:
        return job
    if len(ids) > 1:
        raise AmbiguousJobError(text, ids[:MAX_CANDIDATES], len(ids) > MAX_CANDIDATES)
    raise UnknownJobError(f"no job {text!r}")
