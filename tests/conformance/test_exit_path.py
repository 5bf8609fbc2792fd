"""A script ends under ddpd as it ends under torchrun, that is as `python script.py` ends: what it left
for the interpreter's exit happens (atexit handlers, non-daemon threads joined, open files flushed
and closed, `logging.shutdown`, un-awaited async checkpoints finished, DataLoader workers shut down
by their own exit hooks), its failure is reported as torchrun reports it, and its files get the
submitter's umask. Each case runs under torchrun and ddpd (pooled and cold ranks) and is compared on
exit status, RESULT lines, the files' bytes and leftovers.

The scripts here train without a DistributedDataParallel wrapper (they all-reduce gradients): with
torch 2.13 on CPU, a DDP model or a process group still alive while the interpreter finalizes aborts
the rank now and then ("terminate called without an active exception", a gloo thread taking the GIL
during finalization), under torchrun as under any launcher that lets Python finish; they destroy the
process group before they end (the async checkpoint: from an atexit handler, after the save)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import Daemons, Failure, assert_conform, launch_all

pytestmark = [pytest.mark.anyio, pytest.mark.conformance, pytest.mark.xdist_group("conformance")]


async def test_dcp_sync_save_and_load(daemons: Daemons, tmp_path: Path) -> None:
    outcomes = await launch_all(daemons, tmp_path, "dcp_checkpoint.py", ["--mode", "sync"])
    ref = outcomes["torchrun"]
    assert ref.status == 0, ref.output
    assert set(ref.files) == {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"}
    assert sum("loaded_equal=True" in line for line in ref.results) == 2
    assert_conform(outcomes)


async def test_dcp_async_save_never_awaited_completes(daemons: Daemons, tmp_path: Path) -> None:
    outcomes = await launch_all(daemons, tmp_path, "dcp_checkpoint.py", ["--mode", "async"])
    ref = outcomes["torchrun"]
    assert ref.status == 0, ref.output
    assert set(ref.files) == {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"}
    assert_conform(outcomes)


@pytest.mark.parametrize(("context", "persistent"), [("fork", False), ("spawn", False), ("fork", True)],
                         ids=["fork", "spawn", "persistent-module-level"])
async def test_dataloader_workers(daemons: Daemons, tmp_path: Path, context: str, persistent: bool) -> None:
    args = ["--context", context, *(["--persistent"] if persistent else [])]
    outcomes = await launch_all(daemons, tmp_path, "dataloader_workers.py", args)
    ref = outcomes["torchrun"]
    assert ref.status == 0, ref.output
    assert set(ref.files) == {"model.pt"}
    assert_conform(outcomes)


async def test_atexit_unclosed_csv_and_a_non_daemon_thread(daemons: Daemons, tmp_path: Path) -> None:
    outcomes = await launch_all(daemons, tmp_path, "exit_handlers.py")
    ref = outcomes["torchrun"]
    assert ref.status == 0, ref.output
    for rank in range(2):
        assert ref.files[f"losses-rank{rank}.csv"].split(", ")[1] == "101 lines"
        assert {f"atexit-rank{rank}.txt", f"uploaded-rank{rank}.txt"} <= set(ref.files)
    assert_conform(outcomes)


async def test_memory_handler_flushed_by_logging_shutdown(daemons: Daemons, tmp_path: Path) -> None:
    outcomes = await launch_all(daemons, tmp_path, "memory_handler.py")
    ref = outcomes["torchrun"]
    assert ref.status == 0, ref.output
    assert [ref.files[f"log-rank{rank}.txt"].split(", ")[1] for rank in range(2)] == ["50 lines"] * 2
    assert_conform(outcomes)


async def test_record_reports_the_failing_rank(daemons: Daemons, tmp_path: Path) -> None:
    outcomes = await launch_all(daemons, tmp_path, "record_failure.py")
    ref = outcomes["torchrun"]
    assert ref.status == 1, ref.output
    assert ref.failure == Failure(1, 1, "ValueError: bad batch on rank 1"), ref.output
    root_cause = ref.output.partition("Root Cause (first observed failure):")[2]
    assert "error_file: <N/A>" not in root_cause, ref.output  # @record wrote the file torchrun reports from
    assert_conform(outcomes)
    for launcher in ("pooled", "cold"):
        job = outcomes[launcher].job
        assert job is not None and job.root_cause is not None
        assert "raise ValueError" in (job.root_cause.traceback or ""), (launcher, job.root_cause)


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask-022", "umask-027"])
async def test_ranks_get_the_submitters_umask(daemons: Daemons, tmp_path: Path, umask: int) -> None:
    outcomes = await launch_all(daemons, tmp_path, "umask_probe.py", umask=umask)
    ref = outcomes["torchrun"]
    assert ref.status == 0, ref.output
    file_mode, dir_mode = f"{0o666 & ~umask:04o}", f"{0o777 & ~umask:04o}"
    assert ref.results == [f"RESULT rank={rank} file={file_mode} dir={dir_mode}" for rank in range(2)]
    assert_conform(outcomes, modes=True)


async def test_ranks_see_the_start_and_process_a_torchrun_rank_sees(daemons: Daemons, tmp_path: Path) -> None:
    """`sys.orig_argv` was the worker's own command line (``-m ddpd.worker --fd N ... --fork-server``):
    a script that re-executes itself from it ran the worker again. Now it is torchrun's rank's,
    ``python -u SCRIPT ARGS``; and a pooled (forked) rank's main thread and `tempfile` are a fresh one's."""
    outcomes = await launch_all(daemons, tmp_path, "process_probe.py", ["a", "--b", "c"])
    ref = outcomes["torchrun"]
    assert ref.status == 0, ref.output
    expected = "orig_argv=EXE,-u,process_probe.py,a,--b,c argv=process_probe.py,a,--b,c native_id_own=True"
    assert ref.results == [f"RESULT rank={rank} {expected} tempdir_chosen=False" for rank in range(2)]
    assert_conform(outcomes)

