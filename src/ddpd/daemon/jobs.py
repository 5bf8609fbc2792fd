"""Names kept importable from their old home: the records are in `records`, the journal in `journal`."""

from __future__ import annotations

from .bus import EventBus
from .journal import Journal
from .records import Job, Rank, attempt_dir, job_dir, rank_log

__all__ = ["EventBus", "Job", "Journal", "Rank", "attempt_dir", "job_dir", "rank_log"]
