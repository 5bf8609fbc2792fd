"""What every handler of the web view shares: the client, the hub, the token, the templates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import jinja2

from ddpd.client import AsyncClient

from .hub import Hub


@dataclass(frozen=True)
class Web:
    client: AsyncClient
    hub: Hub
    token: str
    env: jinja2.Environment
    viewer: int  # the uid the daemon serves this view as
    refresh: float = 1.0  # seconds between a page's refreshes when no event comes (inf: on events only)

    def url(self, path: str, **query: Any) -> str:
        """`path` with its query and the token (values None or "" left out)."""
        params = {k: v for k, v in query.items() if v is not None and v != ""}
        return f"{path}?{urlencode({**params, 'token': self.token})}"

    def job_url(self, job_id: str, tail: str = "", under: str = "") -> str:
        """The job's page (`tail`: one of its actions; `under`: "/sse" or "/api" for its stream or JSON)."""
        return self.url(f"{under}/jobs/{quote(job_id, safe='')}{tail}")

    def render(self, template: str, **context: Any) -> str:
        return self.env.get_template(template).render(web=self, **context)
