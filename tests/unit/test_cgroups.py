"""cgroup v2 parsing and limit arithmetic (pure); the live paths are in tests/integration/test_identity_blocks.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpd.daemon.contain.cgroups import cpu_max, parse_keyed, parse_mountinfo, parse_proc_cgroup

MOUNTINFO = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
33 31 0:28 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_mountinfo_finds_the_cgroup2_mount() -> None:
    assert parse_mountinfo(MOUNTINFO) == Path("/sys/fs/cgroup/unified")
    assert parse_mountinfo("33 31 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n") is None
    assert parse_mountinfo("41 31 0:38 / /sys/fs/my\\040cg rw - cgroup2 cgroup2 rw\n") == Path("/sys/fs/my cg")


def test_proc_cgroup_takes_the_v2_line() -> None:
    text = "4:memory:/x/y\n1:cpu:/\n0::/system.slice/ddpd.service\n"
    assert parse_proc_cgroup(text) == "/system.slice/ddpd.service"
    assert parse_proc_cgroup("0::/\n") == "/"
    assert parse_proc_cgroup("4:memory:/x\n") is None


def test_keyed_files() -> None:
    assert parse_keyed("populated 1\nfrozen 0\n") == {"populated": "1", "frozen": "0"}


@pytest.mark.parametrize(("cpus", "text"), [(1, "100000 100000"), (1.5, "150000 100000"), (0.001, "1000 100000")])
def test_cpu_max(cpus: float, text: str) -> None:
    assert cpu_max(cpus) == text


@pytest.mark.parametrize("cpus", [0, -1, float("nan"), float("inf")])
def test_cpu_max_refuses_nonsense(cpus: float) -> None:
    with pytest.raises(ValueError, match="cpus must be a positive number"):
        cpu_max(cpus)
