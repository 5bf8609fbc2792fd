"""Stacks on demand and hang sites, as pure logic: grouping, bounds, and where a script rank is."""

from __future__ import annotations

import sysconfig
import threading

import msgspec
import pytest

from ddpd.cli.stacks import rank_list, render
from ddpd.daemon.attempt.stacks import fit, group_stacks
from ddpd.daemon.run.rootcause import explain_hang, locate
from ddpd.protocol.channel import STACK_TEXT, Stacks, ThreadStack
from ddpd.protocol.control import RankStacks, RootCause, StacksResult
from ddpd.worker.stacks import current_stacks, dump_flight_recorder

TORCH = sysconfig.get_paths()["purelib"] + "/torch"
REPO = "/home/u/project"
DDPD = "/opt/ddpd/src/ddpd/worker"


def _stacks(request: int, main: str, extra: str = "idle") -> Stacks:
    return Stacks(request=request, threads=[ThreadStack(name="MainThread", main=True, stack=main),
                                            ThreadStack(name="ddpd-heartbeat", main=False, stack=extra)])


def test_identical_stacks_are_shown_once_with_the_ranks_that_share_them() -> None:
    answers = {2: _stacks(1, "in train"), 0: _stacks(1, "in train"), 1: _stacks(1, "in all_reduce")}
    groups = group_stacks(answers)
    assert [(g.thread, g.ranks, g.stack, g.main) for g in groups] == [
        ("MainThread", [0, 2], "in train", True),
        ("MainThread", [1], "in all_reduce", True),
        ("ddpd-heartbeat", [0, 1, 2], "idle", False),
    ]


def test_a_result_too_large_for_one_reply_is_clipped_then_cut_and_says_so() -> None:
    answers = {r: _stacks(1, f"rank {r} " + "x" * STACK_TEXT) for r in range(64)}
    result = StacksResult(job_id="j", attempt=1, groups=group_stacks(answers),
                          ranks=[RankStacks(rank=r, state="TRAINING", answered=True) for r in range(64)])
    assert len(msgspec.json.encode(result)) > 100_000
    small = fit(result, 100_000)
    assert len(msgspec.json.encode(small)) <= 100_000
    assert small.note is not None and "clipped" in small.note
    tiny = fit(result, 8_000)
    assert len(msgspec.json.encode(tiny)) <= 8_000
    assert tiny.note is not None and "left out" in tiny.note
    assert fit(tiny, 8_000) is tiny  # a result that fits is left as it is


def test_the_worker_answers_with_every_other_thread_main_first() -> None:
    release = threading.Event()

    def parked_in_a_recognisable_function() -> None:
        release.wait(30)

    helper = threading.Thread(target=parked_in_a_recognisable_function, name="helper")
    helper.start()
    try:
        reply = current_stacks(7)  # asked from the main thread here: the main thread is the caller
    finally:
        release.set()
        helper.join(10)
    assert reply.request == 7
    names = [t.name for t in reply.threads]
    assert "helper" in names and "MainThread" not in names
    helper_stack = next(t for t in reply.threads if t.name == "helper").stack
    assert "in parked_in_a_recognisable_function" in helper_stack
    assert all(len(t.stack) <= STACK_TEXT for t in reply.threads)


def test_the_flight_recorder_is_dumped_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", raising=False)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    assert dump_flight_recorder() == "flight recorder: not enabled for this job"
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/nonexistent/nccl-trace-rank-")
    assert dump_flight_recorder() == "flight recorder: no process group"  # (the gloo case: test_script_progress)


def _dump(*frames: str) -> str:
    lines = ["Current thread 0x00007f0000000001 (most recent call first):"]
    lines += [f'  File "{f.split(":")[0]}", line {f.split(":")[1]} in {f.split(":")[2]}' for f in frames]
    lines += ['  File "<frozen runpy>", line 88 in _run_code',
              '  File "<frozen runpy>", line 198 in _run_module_as_main']
    return "\n".join(lines) + "\n"


SCRIPT_TAIL = (f"{REPO}/train.py:75:<module>", "<frozen runpy>:88:_run_code", "<frozen runpy>:287:run_path",
               f"{DDPD}/script.py:70:run_script", f"{DDPD}/bootstrap.py:180:main", f"{DDPD}/__main__.py:5:<module>")


def test_a_script_rank_is_located_in_the_scripts_own_code() -> None:
    in_collective = _dump(f"{TORCH}/distributed/distributed_c10d.py:2800:all_reduce",
                          f"{TORCH}/distributed/c10d_logger.py:81:wrapper",
                          f"{REPO}/train.py:30:log_metric", f"{REPO}/train.py:60:main", *SCRIPT_TAIL)
    site = locate(1, in_collective)
    assert site is not None and site.in_torch
    assert str(site.where) == f"{REPO}/train.py:30 in log_metric"
    # in ddpd's wrapper of init_process_group: the script's call is named, never the wrapper
    joining = _dump(f"{TORCH}/distributed/distributed_c10d.py:1600:init_process_group",
                    f"{DDPD}/script.py:40:init_process_group", f"{REPO}/train.py:50:main", *SCRIPT_TAIL)
    site = locate(0, joining)
    assert site is not None and str(site.where) == f"{REPO}/train.py:50 in main"


def test_a_script_installed_as_a_library_is_located_at_its_first_frame() -> None:
    lib = sysconfig.get_paths()["purelib"] + "/mypkg"
    dump = _dump(f"{TORCH}/distributed/distributed_c10d.py:2800:all_reduce", f"{lib}/train.py:30:step",
                 f"{lib}/train.py:80:<module>", "<frozen runpy>:88:_run_code", "<frozen runpy>:98:_run_module_code",
                 "<frozen runpy>:226:run_module", f"{DDPD}/script.py:68:run_script", f"{DDPD}/bootstrap.py:180:main")
    site = locate(0, dump)
    assert site is not None and str(site.where) == f"{lib}/train.py:80 in <module>"


def test_the_rank_behind_by_its_step_counter_is_the_culprit_when_all_wait_in_torch() -> None:
    behind = locate(1, _dump(f"{TORCH}/distributed/distributed_c10d.py:2800:all_reduce",
                             f"{REPO}/train.py:30:log_metric", *SCRIPT_TAIL))
    waiting = locate(0, _dump(f"{TORCH}/autograd/graph.py:824:_engine_run_backward",
                              f"{TORCH}/_tensor.py:625:backward", f"{REPO}/train.py:58:main", *SCRIPT_TAIL))
    assert behind is not None and waiting is not None
    cause = RootCause(reason="progress_timeout", rank=0, ranks=[0, 1], detail="step counter frozen")
    explained = explain_hang(cause, {0: waiting, 1: behind}, {0: 21, 1: 20})
    assert explained.rank == 1 and explained.ranks == [1, 0]
    detail = explained.detail or ""
    assert "rank 1 is behind: step 20, rank(s) [0] at 21" in detail
    assert f"{REPO}/train.py:30 in log_metric" in detail
    assert "rank(s) [0] wait for rank 1 inside torch" in detail


def test_a_rank_stuck_outside_torch_is_still_named_before_one_behind() -> None:
    stuck = locate(1, _dump(f"{REPO}/train.py:12:load_batch", *SCRIPT_TAIL))
    waiting = locate(0, _dump(f"{TORCH}/distributed/distributed_c10d.py:2800:all_reduce",
                              f"{REPO}/train.py:58:main", *SCRIPT_TAIL))
    assert stuck is not None and waiting is not None
    cause = RootCause(reason="progress_timeout", rank=0, ranks=[0, 1])
    explained = explain_hang(cause, {0: waiting, 1: stuck}, {0: 3, 1: 5})
    assert explained.rank == 1 and explained.ranks == [1, 0]


def test_ranks_are_listed_as_ranges_and_groups_rendered_with_them() -> None:
    assert rank_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert rank_list([3]) == "3"
    result = StacksResult(job_id="j", attempt=1, groups=group_stacks({0: _stacks(1, "A\n"), 1: _stacks(1, "A\n")}),
                          ranks=[RankStacks(rank=0, state="TRAINING", answered=True),
                                 RankStacks(rank=1, state="TRAINING", answered=True)])
    text = render(result)
    assert "== ranks 0-1 · thread MainThread ==\nA\n" in text
