"""A queued job's place in line in the summary views: set from the scheduler's order, kept in the
view everyone may see, shown as "QUEUED #3" in `ls` and "#3 in line" in `status`."""

from __future__ import annotations

from rich.console import Console

from ddpd.cli.render import job_detail, state_text
from ddpd.client import JobSpec, JobState
from ddpd.daemon.control.replies import job_page, positioned, summary_view
from ddpd.daemon.store.records import Job


def queued(seq: int) -> Job:
    return Job(id=f"j{seq}", seq=seq, name="secret-name", owner_uid=1000, spec=JobSpec(task="two-layer", nproc=2),
               state=JobState.QUEUED, submitted_at=0.0)


def _text(renderable: object) -> str:
    console = Console(width=120, record=True)
    console.print(renderable)
    return console.export_text()


def test_the_place_in_line_reaches_every_view_and_others_see_it_too() -> None:
    a, b = queued(1), queued(2)
    positions = {"j2": 1, "j1": 2}
    assert positioned(a.view(), positions).queue_position == 2
    assert positioned(a.view(), {}).queue_position is None  # started (or ended): no place in line
    hidden = summary_view(positioned(b.view(), positions))
    assert hidden.queue_position == 1 and hidden.name == ""
    page = job_page([a, b], active_only=True, limit=10, before=None, detail=lambda uid: False, positions=positions)
    assert {v.id: v.queue_position for v in page.jobs} == {"j1": 2, "j2": 1}


def test_ls_and_status_show_the_place_in_line() -> None:
    view = positioned(queued(1).view(), {"j1": 3})
    assert state_text(view).plain == "QUEUED #3"
    assert "#3 in line" in _text(job_detail(view, 1.0))
    assert state_text(queued(1).view()).plain == "QUEUED"
