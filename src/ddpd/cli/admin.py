"""ddpctl's commands about the daemon and the shell: ping, daemon, whoami, reload, gpu release, share, completion."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from ddpd.client import ShareResult, WhoAmI

from .completion import SHELLS, completion_script
from .daemon_view import daemon_grid
from .group import cli, client_for, output_option, socket_option
from .output import note, print_json, show
from .words import duration_text


@cli.command()
@socket_option
def ping(socket_path: Path | None) -> None:
    """Check that the daemon answers; print the round trip."""
    client = client_for(socket_path)
    seconds = client.ping()
    click.echo(f"pong from {client.socket_path}: {seconds * 1000:.3f} ms")


@cli.command("daemon")
@output_option
@socket_option
def daemon_info(output: str, socket_path: Path | None) -> None:
    """Show the daemon: version, pid, uptime, socket, state dir, load and resources."""
    info = client_for(socket_path).daemon_info()
    if output == "json":
        print_json(info)
        return
    show(daemon_grid(info))


@cli.command()
@output_option
@socket_option
def whoami(output: str, socket_path: Path | None) -> None:
    """Show who the daemon takes you for: uid, name, groups, and what you may see and do."""
    me = client_for(socket_path).whoami()
    if output == "json":
        print_json(me)
        return
    show(_whoami_grid(me))


def _whoami_grid(me: WhoAmI) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    admin = f" (admin group: {me.admin_group})" if me.admin_group else ""
    rows = [
        ("uid", str(me.uid)),
        ("name", me.name if me.name is not None else "(no passwd entry)"),
        ("groups", ", ".join(me.groups) or "-"),
        ("job detail", ("every job's" if me.detail_of_all else "your own jobs'") + admin),
        ("reload", "allowed" if me.may_reload else "not allowed (root or the daemon's user only)"),
        ("submit", "allowed" if me.submit_refusal is None else f"refused: {me.submit_refusal}"),
    ]
    for key, value in rows:
        grid.add_row(key, Text(value))
    return grid


@cli.command()
@socket_option
def reload(socket_path: Path | None) -> None:
    """Ask the daemon to reload its configuration."""
    client_for(socket_path).reload()
    note("reloaded")


@cli.group()
def gpu() -> None:
    """The daemon's GPUs (root and the admin group)."""


@gpu.command("release")
@click.argument("gpu_name", metavar="GPU")
@socket_option
def gpu_release(gpu_name: str, socket_path: Path | None) -> None:
    """Put a quarantined GPU (an Xid, an ECC error) back in service: GPU is its index or UUID."""
    done = client_for(socket_path).gpu_release(gpu_name)
    note(f"released {done.gpu} (quarantined for: {done.reason})")


@cli.command()
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the shell completion script for SHELL (job ids complete from the daemon).

    bash: eval "$(ddpctl completion bash)" in ~/.bashrc; zsh: the same in ~/.zshrc;
    fish: ddpctl completion fish > ~/.config/fish/completions/ddpctl.fish
    """
    click.echo(completion_script(cli, shell))




@cli.command()
@output_option
@socket_option
def share(output: str, socket_path: Path | None) -> None:
    """Show each user's recent usage and fair-share factor (the next served first).

    Usage is GPU-seconds and CPU-slot-seconds, halving every half-life; among jobs of equal priority,
    the user with the higher factor (less used lately) goes first.
    """
    result = client_for(socket_path).share()
    if output == "json":
        print_json(result)
        return
    if not result.users:
        note("no usage recorded and no jobs")
        return
    show(_share_table(result))


def _share_table(result: ShareResult) -> Table:
    half = f"half-life {duration_text(result.half_life)}" if result.half_life else "no decay"
    table = Table(title=f"fair share ({half})", title_justify="left")
    for name in ("user", "GPU-s", "CPU-s", "usage", "factor", "running", "queued"):
        table.add_column(name, justify="left" if name == "user" else "right")
    for v in result.users:
        who = f"{v.name} ({v.uid})" if v.name else str(v.uid)
        table.add_row(Text(who), f"{v.gpu_seconds:.0f}", f"{v.cpu_seconds:.0f}", f"{v.usage:.0%}", f"{v.factor:.2f}",
                      str(v.running), str(v.queued))
    return table
