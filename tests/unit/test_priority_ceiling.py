"""Priority above the default is the operator's to grant (issue 34, finding 10): a ceiling per user and
per group in the config, 0 for everyone else; root, the daemon's own user and the admin group are
bounded by priority_range alone."""

from __future__ import annotations

import grp
import pwd
from pathlib import Path

import pytest

from ddpd.daemon.config import Config, ConfigError, load_config
from ddpd.daemon.queue.admission import check_priority, priority_ceiling_of
from ddpd.protocol import JobSpec, SpecError

pytestmark = pytest.mark.anyio


def _nobody() -> tuple[int, str, str]:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user `nobody` here")
    return entry.pw_uid, entry.pw_name, grp.getgrgid(entry.pw_gid).gr_name


def test_the_ceiling_of_a_user_is_the_greatest_it_was_granted() -> None:
    uid, name, group = _nobody()
    assert priority_ceiling_of(uid, Config()) == 0
    assert priority_ceiling_of(uid, Config(user_priority_ceilings={name: 7})) == 7
    assert priority_ceiling_of(uid, Config(user_priority_ceilings={name: 7}, group_priority_ceilings={group: 9})) == 9
    assert priority_ceiling_of(uid, Config(priority_ceiling=20, user_priority_ceilings={name: 7})) == 20
    assert priority_ceiling_of(uid, Config(user_priority_ceilings={"someone-else": 7})) == 0
    assert priority_ceiling_of(uid, Config(admin_group=group)) is None  # an admin: priority_range alone
    assert priority_ceiling_of(0, Config()) is None
    assert priority_ceiling_of(3_999_999, Config(priority_ceiling=2)) == 2  # no passwd entry: the default


async def test_a_priority_above_the_ceiling_is_refused_naming_it() -> None:
    uid, name, _ = _nobody()
    with pytest.raises(SpecError, match=r"^priority: 1000 is above 0, the highest priority uid \d+ may ask for"):
        await check_priority(JobSpec(task="two-layer", priority=1000), Config(), uid)
    await check_priority(JobSpec(task="two-layer", priority=-5), Config(), uid)  # lower: anyone's choice
    await check_priority(JobSpec(task="two-layer", priority=0), Config(), uid)
    granted = Config(user_priority_ceilings={name: 50})
    await check_priority(JobSpec(task="two-layer", priority=50), granted, uid)
    with pytest.raises(SpecError, match="51 is above 50"):
        await check_priority(JobSpec(task="two-layer", priority=51), granted, uid)
    await check_priority(JobSpec(task="two-layer", priority=1000), Config(), 0)


def test_ceilings_are_config_keys_with_ranges(tmp_path: Path) -> None:
    path = tmp_path / "ddpd.toml"
    path.write_text('priority_ceiling = 1\n[user_priority_ceilings]\nalice = 100\n'
                    '[group_priority_ceilings]\nml-leads = 500\n')
    cfg = load_config(path)
    assert (cfg.priority_ceiling, dict(cfg.user_priority_ceilings), dict(cfg.group_priority_ceilings)) == (
        1, {"alice": 100}, {"ml-leads": 500})
    for bad, key in (("priority_ceiling = -1\n", "priority_ceiling"),
                     ("[user_priority_ceilings]\nalice = -3\n", "user_priority_ceilings"),
                     ('[group_priority_ceilings]\n"" = 3\n', "group_priority_ceilings")):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=key):
            load_config(path)
