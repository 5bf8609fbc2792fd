"""Helpers shared by the queue, script-mode, CLI and owner tests (no fixtures here: see conftest)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio

from ddpd.client import AsyncClient
from ddpd.protocol.control import EventView

from ..conftest import JOB_TIMEOUT, REPO, DaemonProc

SCRIPTS = REPO / "tests" / "scripts"
ENV_MARK = "ddpd-test-env "


async def rank_reports(client: AsyncClient, job_id: str) -> dict[int, dict[str, Any]]:
    """What each rank printed on its `ddpd-test-env` line (gated.py, show_env.py), by rank."""
    found: dict[int, dict[str, Any]] = {}
    async with client.logs(job_id) as chunks:
        text: dict[int, str] = {}
        async for chunk in chunks:
            text[chunk.rank] = text.get(chunk.rank, "") + chunk.text
    for rank, body in text.items():
        for line in body.splitlines():
            if line.startswith(ENV_MARK):
                found[rank] = json.loads(line[len(ENV_MARK):])
    return found


def state_is(state: str) -> Any:
    def match(e: EventView) -> bool:
        return e.kind == "job.state_changed" and bool(e.data.get("to") == state)

    return match


async def wait_state(d: DaemonProc, job_id: str, state: str) -> EventView:
    return await d.wait_event(job_id, state_is(state))


async def wait_waiting_at_gate(d: DaemonProc, job_id: str, ranks: int = 1) -> None:
    """Every rank of a gated job is inside its first step (it printed so, after joining)."""
    await d.wait_event(job_id, state_is("RUNNING"))
    seen = 0
    with anyio.fail_after(JOB_TIMEOUT):
        async with d.client.logs(job_id, follow=True) as chunks:
            async for chunk in chunks:
                seen += chunk.text.count("waiting for gate")
                if seen >= ranks:
                    return
    raise AssertionError(f"job {job_id} ended before {ranks} rank(s) reached the gate")


def gated(d: DaemonProc, gate: Path, **kw: Any) -> Any:
    """A job of the gated task: it holds step 1 until `gate` exists."""
    kw.setdefault("steps", 2)
    options = {"gate": str(gate), **kw.pop("options", {})}
    return d.spec(task="tests.scripts.gated:make_task", options=options, **kw)
