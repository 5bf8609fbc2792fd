"""The daemon config is typed: every bad key is one ConfigError naming it; secrets are guarded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from ddpd.daemon.config import Config, ConfigError, check_config, load_config, reloaded, restart_only
from ddpd.protocol import Timeouts


def _load(tmp_path: Path, text: str, **overrides: object) -> Config:
    path = tmp_path / "ddpd.toml"
    path.write_text(text)
    return load_config(path, **overrides)


@pytest.mark.parametrize(("text", "key"), [
    ('cpu_slots = "16"', "cpu_slots"),  # the bug: a bare TypeError at start
    ('[defaults]\njoin = "120"', "defaults.join"),  # the bug: accepted by reload, then every job failed
    ("cpu_slots = 0", "cpu_slots"),
    ("cpu_slots = true", "cpu_slots"),
    ("max_running = -1", "max_running"),
    ("heartbeat_interval = 0", "heartbeat_interval"),
    ("pool_start_timeout = 0", "pool_start_timeout"),
    ("pool_start_timeout = inf", "pool_start_timeout"),
    ("port_range = [2000, 1000]", "port_range"),
    ("port_range = [0, 10]", "port_range"),
    ("port_range = [1, 2, 3]", "port_range"),
    ("priority_range = [5, 1]", "priority_range"),
    ("priority_range = [0, 9223372036854775807]", "priority_range"),
    ('socket_mode = "0999"', "socket_mode"),
    ("socket_mode = 660", "socket_mode"),  # decimal by mistake: above 0o777
    ("max_kill_grace = 10\n[defaults]\nkill_grace = 20", "defaults.kill_grace"),
    ("max_kill_grace = 604800", "max_kill_grace"),
    ("[defaults]\nwall = 0", "defaults.wall"),
    ("[defaults]\nheartbeat = nan", "defaults.heartbeat"),
    ("[defaults]\nprogress = inf", "defaults.progress"),
    ("idle_timeout = -1", "idle_timeout"),
    ("frame_timeout = 0", "frame_timeout"),
    ("max_connections = 0", "max_connections"),
    ("retention = -5", "retention"),
    ("rank_log_max = 10", "rank_log_max"),
    ("gpus = -1", "gpus"),
    ("worker_command = []", "worker_command"),
    ("worker_command = [1]", "worker_command"),
    ('log_level = "loud"', "log_level"),
    ('log_format = "xml"', "log_format"),
    ('stop_signal = "SIGKILL"', "stop_signal"),  # it would end the rank, not warn it
    ('cpu_rank_policy = "fifo"', "cpu_rank_policy"),
    ("stop_signal = 10", "stop_signal"),
    ("frobnicate = 1", "frobnicate"),
    ("[defaults]\nbogus = 1", "defaults.bogus"),
])
def test_a_bad_key_is_one_error_naming_it(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    message = str(err.value)
    assert key in message, message
    assert "\n" not in message


def test_good_values_are_typed(tmp_path: Path) -> None:
    cfg = _load(tmp_path, 'socket_mode = "0640"\nport_range = [29500, 29599]\ncpu_slots = 4\n'
                          "priority_range = [-10, 10]\n[defaults]\njoin = 30\nwall = 3600\n")
    assert cfg.socket_mode == 0o640 and cfg.port_range == (29500, 29599) and cfg.cpu_slots == 4
    assert cfg.priority_range == (-10, 10)
    assert cfg.defaults.join == 30.0 and isinstance(cfg.defaults.join, float) and cfg.defaults.wall == 3600
    assert cfg.defaults.heartbeat == 10.0  # untouched defaults keep the built-in value


def test_flags_are_checked_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cpu_slots"):
        load_config(None, cpu_slots=0)
    with pytest.raises(ConfigError, match="max_connections"):
        check_config(Config(max_connections=-3))


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"ddpd\.toml"):
        _load(tmp_path, "cpu_slots = = 3")


def test_metrics_token_file_must_be_private(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret-token\n")
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match=r"metrics_token_file.*chmod 600"):
        _load(tmp_path, f'metrics_token_file = "{secret}"')
    secret.chmod(0o600)
    assert _load(tmp_path, f'metrics_token_file = "{secret}"').metrics_token == "s3cret-token"
    link = tmp_path / "link"
    link.symlink_to(secret)
    with pytest.raises(ConfigError, match="metrics_token_file"):
        _load(tmp_path, f'metrics_token_file = "{link}"')
    with pytest.raises(ConfigError, match="not both"):
        _load(tmp_path, f'metrics_token = "x"\nmetrics_token_file = "{secret}"')


def test_world_readable_config_with_a_token_warns(tmp_path: Path) -> None:
    path = tmp_path / "ddpd.toml"
    path.write_text('metrics_token = "s3cret"\n')
    os.chmod(path, 0o644)
    with structlog.testing.capture_logs() as logs:
        assert load_config(path).metrics_token == "s3cret"
    assert [e["event"] for e in logs] == ["config.secret_readable"]
    os.chmod(path, 0o600)
    with structlog.testing.capture_logs() as logs:
        load_config(path)
    assert logs == []


def test_serve_with_a_bad_file_prints_one_line_naming_the_key(tmp_path: Path) -> None:
    """The bug: `cpu_slots = "16"` made `ddpd serve` die with a bare TypeError."""
    import subprocess
    import sys

    path = tmp_path / "ddpd.toml"
    path.write_text('cpu_slots = "16"\n')
    done = subprocess.run([sys.executable, "-m", "ddpd.daemon", "serve", "--config", str(path), "--socket",
                           str(tmp_path / "s"), "--state-dir", str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cpu_slots" in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "state").exists()


def test_a_loaded_config_checks_again(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("tok")
    secret.chmod(0o600)
    check_config(_load(tmp_path, f'metrics_listen = "0.0.0.0:9464"\nmetrics_token_file = "{secret}"'))


def test_config_file_is_not_a_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'config_file'"):
        _load(tmp_path, 'config_file = "/etc/other.toml"')


def test_a_reload_keeps_the_restart_only_keys_and_names_them(tmp_path: Path) -> None:
    """The keys a reload cannot change are the fields marked RESTART (one declaration, no second list)."""
    assert set(restart_only()) >= {"socket", "state_dir", "socket_mode", "socket_group", "gpus", "log_format",
                                   "metrics_listen", "metrics_token", "metrics_public", "pool_size", "pool_per_key",
                                   "pool_idle_expiry", "cgroup", "nft_library"}
    assert not {"max_running", "log_level", "defaults", "worker_command", "cpu_slots"} & set(restart_only())
    old = Config(state_dir=tmp_path / "a", socket=tmp_path / "s")
    new = Config(state_dir=tmp_path / "b", socket=tmp_path / "s", max_running=3, pool_size=0,
                 defaults=Timeouts(join=7.0))
    applied, changed, ignored = reloaded(old, new)
    assert applied.state_dir == tmp_path / "a" and applied.pool_size == old.pool_size
    assert applied.max_running == 3 and applied.defaults.join == 7.0
    assert changed == ["defaults", "max_running"] and sorted(ignored) == ["pool_size", "state_dir"]
