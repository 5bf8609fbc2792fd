"""ddpctl's click group and what its commands share: the socket and output options, the client,
exit codes, and the error handling that turns expected errors into one line on stderr.

Exit codes: 0 success, 1 failure (an error reply, a job that did not succeed), 2 usage or a
bad job spec, 3 the daemon cannot be reached, 130 interrupted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ddpd.client import Client, DaemonUnavailable, ErrorCode, JobState, JobView, RemoteError, SpecError

from . import render
from .output import error, note

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130

_USAGE_CODES = frozenset({ErrorCode.BAD_SPEC.value})


class _Group(click.Group):
    """Turns expected errors into one line on stderr and an exit code, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DaemonUnavailable as exc:
            error(exc.message)
            ctx.exit(EXIT_UNAVAILABLE)
        except RemoteError as exc:
            error(f"{exc.code}: {exc.message}")
            ctx.exit(EXIT_USAGE if exc.code in _USAGE_CODES else EXIT_FAILED)
        except SpecError as exc:
            error(f"{ErrorCode.BAD_SPEC}: {exc}")
            ctx.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            ctx.exit(EXIT_INTERRUPTED)


# not checked for readability here: a socket the user may not open is reported by the client
# (exit 3, "permission denied (are you in the socket's group?)"), not as a usage error
_SOCKET_PATH = click.Path(path_type=Path, readable=False)
_SOCKET_HELP = "Control socket of the daemon (default: $DDPD_SOCKET, else the user's, else the system's)."


def socket_option(func: F) -> F:
    return click.option("--socket", "socket_path", type=_SOCKET_PATH, default=None, help=_SOCKET_HELP)(func)


def output_option(func: F) -> F:
    return click.option(
        "-o",
        "--output",
        type=click.Choice(["table", "json"]),
        default="table",
        show_default=True,
        help="Output format (json: pure JSON on stdout).",
    )(func)


def text_output_option(help: str) -> Callable[[F], F]:
    return click.option(
        "-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True, help=help
    )


def socket_of(socket_path: Path | None) -> Path | None:
    if socket_path is not None:
        return socket_path
    root = click.get_current_context().find_root()
    value = root.params.get("socket_path")
    return value if isinstance(value, Path) else None


def client_for(socket_path: Path | None) -> Client:
    return Client(socket_of(socket_path))


def exit_for(view: JobView) -> None:
    sys.exit(0 if view.state == JobState.SUCCEEDED else EXIT_FAILED)


def report_final(view: JobView) -> None:
    ok = view.state == JobState.SUCCEEDED
    note(render.final_line(view), "green" if ok else "red")
    if not ok and view.root_cause is not None and view.root_cause.traceback:
        note(view.root_cause.traceback.rstrip("\n"))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_path",
    type=_SOCKET_PATH,
    envvar="DDPD_SOCKET",
    show_envvar=True,
    default=None,
    help="Control socket of the daemon (also accepted after the command name).",
)
@click.version_option(package_name="ddpd", prog_name="ddpctl")
def cli(socket_path: Path | None) -> None:
    """Submit, watch and control PyTorch DDP jobs run by the ddpd daemon."""


