"""`--mem` and `--cpus`: parsed at the door, written to the attempt's cgroup where the daemon has the
controller, reported unavailable (with the reason) where it has not, or where there is no cgroup."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from ddpd.cli.specs import parse_bytes
from ddpd.client import JobSpec, SpecError, build_spec
from ddpd.daemon.contain.cgroups import Cgroup, Subtree
from ddpd.daemon.contain.joblimits import apply_limits, wanted


def test_sizes_are_read_as_people_write_them() -> None:
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("8G") == 8 << 30 and parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes("4096") == 4096 and parse_bytes("2k") == 2048
    with pytest.raises(click.BadParameter, match="a size such as 512M"):
        parse_bytes("lots")


def test_limits_are_bounded_at_the_door() -> None:
    with pytest.raises(SpecError, match="memory"):
        build_spec({"memory": 10})
    with pytest.raises(SpecError, match="cpus"):
        build_spec({"cpus": 0})
    assert build_spec({"memory": 1 << 30, "cpus": 1.5}).cpus == 1.5


def fake_cgroup(tmp_path: Path, *files: str) -> Cgroup:
    """A directory standing in for an attempt's cgroup: the interface files a controller would add."""
    for name in files:
        (tmp_path / name).write_text("max\n")
    return Cgroup(tmp_path)


def test_a_delegated_controller_gets_the_limit(tmp_path: Path) -> None:
    cg = fake_cgroup(tmp_path, "memory.max", "cpu.max")
    subtree = Subtree(tmp_path, tmp_path, frozenset({"memory", "cpu"}))
    done = apply_limits(JobSpec(memory=1 << 30, cpus=1.5), cg, subtree)
    assert done.applied == {"memory.max": str(1 << 30), "cpu.max": "150000 100000"} and not done.unavailable
    assert (tmp_path / "memory.max").read_text() == str(1 << 30)


def test_a_missing_controller_is_reported_with_the_reason_and_nothing_is_faked(tmp_path: Path) -> None:
    cg = fake_cgroup(tmp_path, "memory.max")
    reason = "controller cpu is not enabled at the root of /sys/fs/cgroup/unified (cgroup.subtree_control)"
    subtree = Subtree(tmp_path, tmp_path, frozenset({"memory"}), {"cpu": reason})
    done = apply_limits(JobSpec(memory=1 << 30, cpus=2.0), cg, subtree)
    assert done.applied == {"memory.max": str(1 << 30)}
    assert done.unavailable == {"cpu": f"{reason}; limit not applied"}
    assert not (tmp_path / "cpu.max").exists()


def test_without_a_cgroup_every_limit_is_unavailable() -> None:
    done = apply_limits(JobSpec(cpus=1.0), None, None)
    assert not done.applied and "no cgroup v2" in done.unavailable["cpu"]
    assert wanted(JobSpec()) == {} and apply_limits(JobSpec(), None, None).unavailable == {}
