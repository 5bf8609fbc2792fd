"""A job's timeouts are one type: the spec's (None: the daemon's default), the config's [defaults]
table (the built-in values where it gives none) and a job's resolved timeouts (`over`), with the
submit options of ddpctl made from the same declaration. The wire and file formats are unchanged."""

from __future__ import annotations

from pathlib import Path

import click
import msgspec
import pytest

from ddpd.cli.commands import submit
from ddpd.cli.specs import spec_from_options
from ddpd.client import SpecError, build_spec
from ddpd.daemon.config import Config, ConfigError, load_config
from ddpd.protocol import JobSpec, Timeouts, encode
from ddpd.protocol.timeouts import WEEK, need

BUILTIN = Timeouts(join=120.0, heartbeat=10.0, progress=600.0, wall=None, kill_grace=5.0, stop_warning=30.0)

# the frames of these specs as the release before the one type encoded them (captured from it)
WIRE = [
    (JobSpec(task="two-layer"), b'{"task":"two-layer","timeouts":{}}\n'),
    (JobSpec(task="two-layer", timeouts=Timeouts(join=5.0, wall=60.0, kill_grace=2.0)),
     b'{"task":"two-layer","timeouts":{"join":5.0,"wall":60.0,"kill_grace":2.0}}\n'),
    (JobSpec(task="two-layer", timeouts=Timeouts(join=1.0, heartbeat=2.0, progress=3.0, wall=4.0, kill_grace=5.0,
                                                 stop_warning=6.0)),
     b'{"task":"two-layer","timeouts":{"join":1.0,"heartbeat":2.0,"progress":3.0,"wall":4.0,"kill_grace":5.0,'
     b'"stop_warning":6.0}}\n'),
]


@pytest.mark.parametrize(("spec", "frame"), WIRE)
def test_a_spec_s_wire_bytes_are_unchanged(spec: JobSpec, frame: bytes) -> None:
    assert encode(spec) == frame
    assert msgspec.json.decode(frame, type=JobSpec) == spec
    assert msgspec.json.decode(b'{"task":"two-layer"}', type=JobSpec).timeouts == Timeouts()  # an old client's


@pytest.mark.parametrize("key", Timeouts.__struct_fields__)
@pytest.mark.parametrize("value", [0, -1.0, WEEK + 1, "10"])
def test_a_value_out_of_bounds_is_refused_naming_the_key(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(SpecError) as spec_err:
        build_spec({"task": "two-layer", "timeouts": {key: value}})
    assert spec_err.value.field == f"timeouts.{key}", spec_err.value
    path = tmp_path / "ddpd.toml"
    path.write_text(f"[defaults]\n{key} = {value!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=rf"defaults\.{key}: expected"):
        load_config(path)


def test_a_week_is_the_longest_timeout() -> None:
    assert build_spec({"task": "two-layer", "timeouts": {"wall": WEEK}}).timeouts == Timeouts(wall=WEEK)


def test_the_config_s_defaults_are_the_built_in_values_where_its_table_gives_none(tmp_path: Path) -> None:
    assert Config().defaults == BUILTIN == Timeouts.builtin()
    path = tmp_path / "ddpd.toml"
    path.write_text("[defaults]\njoin = 30\n")
    assert load_config(path).defaults == msgspec.structs.replace(BUILTIN, join=30.0)
    assert Config(defaults=Timeouts(kill_grace=2.0)).defaults == msgspec.structs.replace(BUILTIN, kill_grace=2.0)


def test_a_job_s_own_timeouts_win_and_the_config_s_fill_the_rest() -> None:
    defaults = Config(defaults=Timeouts(heartbeat=3.0, wall=3600.0)).defaults
    resolved = Timeouts(join=1.0, progress=2.0).over(defaults)
    assert resolved == Timeouts(join=1.0, heartbeat=3.0, progress=2.0, wall=3600.0, kill_grace=5.0, stop_warning=30.0)
    assert Timeouts(wall=60.0).over(defaults).wall == 60.0
    assert need(resolved.join) == 1.0


def test_wall_stays_none_no_limit_once_resolved() -> None:
    resolved = Timeouts(join=1.0).over(Config().defaults)
    assert resolved.wall is None  # no wall-time limit, not 0 or a sentinel
    assert all(need(getattr(resolved, key)) > 0 for key in Timeouts.__struct_fields__ if key != "wall")
    with pytest.raises(ValueError, match="unresolved"):
        need(Timeouts().join)


def test_ddpctl_submit_s_timeout_options_are_the_keys() -> None:
    options = {opt: param for param in submit.params if isinstance(param, click.Option) for opt in param.opts}
    for key, declared in Timeouts.keys().items():
        assert options[declared.flag].help == declared.help
        assert spec_from_options({options[declared.flag].name or "": 7.0}, ()).timeouts == Timeouts(**{key: 7.0})
    assert [flag for flag in options if flag in {k.flag for k in Timeouts.keys().values()}] == [
        "--join-timeout", "--heartbeat-timeout", "--progress-timeout", "--wall-time", "--kill-grace", "--stop-warning"]
    with pytest.raises(SpecError) as err:
        spec_from_options({"join_timeout": 0.0}, ())
    assert err.value.field == "timeouts.join"
