"""ddpctl's commands about the daemon and the shell: ping, daemon, reload, completion."""

from __future__ import annotations

from pathlib import Path

import click

from . import render
from .completion import SHELLS, completion_script
from .group import cli, client_for, output_option, socket_option
from .output import note, print_json, stdout


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
    stdout().print(render.daemon_grid(info))


@cli.command()
@socket_option
def reload(socket_path: Path | None) -> None:
    """Ask the daemon to reload its configuration."""
    client_for(socket_path).reload()
    note("reloaded")


@cli.command()
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the shell completion script for SHELL (job ids complete from the daemon).

    bash: eval "$(ddpctl completion bash)" in ~/.bashrc; zsh: the same in ~/.zshrc;
    fish: ddpctl completion fish > ~/.config/fish/completions/ddpctl.fish
    """
    click.echo(completion_script(cli, shell))


