"""A forked worker's command line (`pooled_argv`): the server's, with the worker's own channel as
``--fd`` and no ``--fork-server``, as a whole pooled interpreter's reads."""

from __future__ import annotations

from ddpd.protocol.worker import parse_worker_args, worker_args
from ddpd.worker.forkserver import pooled_argv


def test_the_server_command_line_becomes_a_pooled_interpreters_with_the_workers_channel() -> None:
    server = ["/venv/lib/ddpd/worker/__main__.py", *worker_args(13, 4242, pool=True, fork_server=True)]
    assert pooled_argv(server, 21) == ["/venv/lib/ddpd/worker/__main__.py",
                                       *worker_args(21, 4242, pool=True)]
    args = parse_worker_args(pooled_argv(server, 21)[1:])
    assert (args.fd, args.parent, args.pool, args.fork_server) == (21, 4242, True, False)


def test_the_interpreter_and_its_options_stay_in_orig_argv() -> None:
    orig = ["/usr/bin/python3", "-X", "faulthandler", "-m", "ddpd.worker",
            *worker_args(13, 7, pool=True, fork_server=True)]
    assert pooled_argv(orig, 9) == ["/usr/bin/python3", "-X", "faulthandler", "-m", "ddpd.worker",
                                    "--fd", "9", "--parent", "7", "--pool"]


def test_a_trailing_fd_without_a_value_is_left_as_it_is() -> None:
    assert pooled_argv(["w", "--fd"], 9) == ["w", "--fd"]
