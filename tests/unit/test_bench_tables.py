"""The benchmarks' tables show every side alike: the paired table's ratios to both torchruns (as
started and at SCHED_BATCH), each side's policy, the cores and ranks, and a failed side with its
reason; a failed run counts against its side in the suite's table."""

from __future__ import annotations

from benchmarks import forked_ramp
from benchmarks.context import short_why
from benchmarks.paired_table import describe, median_interval, summarise
from benchmarks.results import Metric
from benchmarks.settle import busy_ticks


def test_paired_table_compares_with_both_torchruns_and_names_policies() -> None:
    rates = {"ddpd": [1300.0, 1320.0, 1310.0], "torchrun": [700.0, 720.0, 730.0],
             "torchrun (batch)": [1280.0, 1300.0, 1350.0], "ddpd (cold)": [1200.0]}
    policies = {"ddpd": "SCHED_BATCH", "torchrun": "SCHED_OTHER", "torchrun (batch)": "SCHED_BATCH",
                "ddpd (cold)": "SCHED_BATCH"}
    result = summarise("tiny", rates, policies, {"ddpd (cold)": "in round 2: rank 0 said nothing"}, 1, 2,
                       "settled 1.0s, quiet")
    vs = result["vs"]
    assert vs["torchrun"]["ddpd"]["values"] == [1300 / 700, 1320 / 720, 1310 / 730]
    assert vs["torchrun (batch)"]["ddpd"]["median"] == 1320 / 1300
    assert result["ratio"]["ddpd"]["median"] == vs["torchrun"]["ddpd"]["median"]  # the suite's key, as before
    assert len(vs["torchrun"]["ddpd (cold)"]["values"]) == 1  # a failed side: the rounds it ran
    text = describe(result)
    assert "2 cores, 1 rank(s) per side (1 core(s) spare)" in text and "settled 1.0s, quiet" in text
    row = next(line for line in text.splitlines() if line.lstrip().startswith("ddpd  "))
    assert "SCHED_BATCH" in row and "1.833x" in row and "1.015x" in row
    assert "FAILED ddpd (cold): in round 2: rank 0 said nothing" in text
    assert "the policy alone here (torchrun at SCHED_BATCH over torchrun): 1.829x [1.806-1.849] n=3" in text


def test_forked_ranks_are_compared_with_cold_ones_round_by_round() -> None:
    rates = {"torchrun": [1.0, 1.0, 1.0], "ddpd (forked)": [99.0, 101.0, 50.0], "ddpd (cold)": [100.0, 100.0, 50.0]}
    result = summarise("tiny", rates, {}, {}, 2, 2)
    assert result["forked_vs_cold"]["values"] == [0.99, 1.01, 1.0]
    assert "forked ranks over cold ranks (the same script, per round): 1.000x [0.990-1.010] n=3" in describe(result)
    assert "forked_vs_cold" not in summarise("tiny", {"torchrun": [1.0], "ddpd (cold)": [1.0]}, {}, {}, 2, 2)


def test_every_core_busy_is_said() -> None:
    result = summarise("tiny", {"torchrun": [1.0], "ddpd": [1.0]}, {}, {}, 2, 2)
    assert "every core busy while a side runs" in describe(result)


def test_median_interval_widens_to_the_range_with_few_rounds() -> None:
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)
    values = [float(v) for v in range(100)]
    low, high = median_interval(values)
    assert 38 <= low < 49.5 < high <= 61


def test_a_failed_run_counts_against_its_side() -> None:
    metric = Metric("hot replacement", "SIGKILL → training again", "s")
    metric.add("ddpd (hot)", 0.14)
    metric.fail("torchrun", "rep 1: BenchError: torchrun exited with 1")
    assert metric.series["torchrun"].values == [] and metric.failures["torchrun"] == [
        "rep 1: BenchError: torchrun exited with 1"]


def test_busy_ticks_read_the_whole_machine() -> None:
    busy, total = busy_ticks()
    assert 0 < busy < total


def test_a_failure_reads_as_one_line_naming_its_cause() -> None:
    """A torchrun's log ends in its agent's ChildFailedError banner and a SIGTERM line; the cause
    (gloo's mesh timing out) is above them."""
    log = ("torchrun exited with 1:\nW1205 Setting OMP_NUM_THREADS ...\n"
           "RuntimeError: Gloo connectFullMesh failed with [pair.cc:152] timed out connecting\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
           "  traceback : Signal 15 (SIGTERM) received by PID 13701\n")
    assert short_why(log) == ("torchrun exited with 1: ... RuntimeError: Gloo connectFullMesh failed with "
                              "[pair.cc:152] timed out connecting")
    assert short_why("job j1 ended FAILED") == "job j1 ended FAILED"
    assert len(short_why("x" * 1000)) == 300


def test_forked_ramp_pairs_run_i_of_each_side_block_by_block_and_shows_a_failed_job() -> None:
    found = {"forked": [{"rates": [900.0, 1000.0], "faults": [1000, 40]},
                        {"rates": [800.0, 1000.0], "faults": [900, 30]}],
             "cold": [{"rates": [1000.0, 1000.0], "faults": [300, 0]}]}
    rows = forked_ramp.per_block(found, 2)
    assert rows[0]["ratio"] == 0.9 and rows[0]["ratio_range"] == (0.9, 0.9)  # run 2 of forked has no cold pair
    assert rows[0]["forked_faults"] == 950 and rows[1]["cold_faults"] == 0 and rows[1]["ratio"] == 1.0
    text = forked_ramp.describe({"nproc": 1, "steps": 2000, "runs": 2, "unsettled": 1, "blocks": rows,
                                 "failed": {"forked": [], "cold": ["job j2 ended FAILED: rank 0 exited 1"]}})
    assert "2 runs a side (1 measured unsettled)" in text
    assert "0.900 [0.900-0.900]" in text and "FAILED cold: job j2 ended FAILED: rank 0 exited 1" in text
