"""Job files: `ddpctl submit -f job.toml`, a TOML file whose keys are the options of `submit`.

Each key is an option's long name (`gpus-per-rank` or `gpus_per_rank`), with a value of that
option's type: an integer, a number, a string (one of the choices, where there are some), true or
false for a flag, and a list of strings for an option that may be given more than once (`env`
and `option` also take a table: `[env]` then `NAME = "value"`). `script` is the script (or the
module, with `module = true`) and its arguments: a string, or a list of strings; `args` is a list
of arguments that follow it.

The keys become the command's defaults (click's `default_map`), so a flag given on the command
line wins over the file, and an option added to `submit` later is a key too, with no code here.
The file is read as hostile input: a regular file (not a FIFO, a device or a symlink) of at most
MAX_JOB_FILE bytes, UTF-8 TOML; every error names the file and the key.
"""

from __future__ import annotations

import difflib
import errno
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

import click

MAX_JOB_FILE = 256 * 1024
SCRIPT_KEYS = ("script", "args")
_TABLES = ("env", "options")  # multiple K=V options a table may give (by parameter name)
_NOT_KEYS = frozenset({"job_file", "help"})


class BadJobFile(click.BadParameter):
    def __init__(self, path: Path | str, message: str) -> None:
        super().__init__(f"{path}: {message}", param_hint="'-f' / '--file'")


def load_job_file(path: Path) -> dict[str, Any]:
    """The TOML of a job file, read safely and bounded; BadJobFile says what is wrong with it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BadJobFile(path, "no such file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadJobFile(path, "is a symlink; give the file it points to") from None
        raise BadJobFile(path, exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else \
                "not a regular file"
            raise BadJobFile(path, f"is {kind}; a job file is a regular file")
        if st.st_size > MAX_JOB_FILE:
            raise BadJobFile(path, f"is {st.st_size} bytes; a job file is at most {MAX_JOB_FILE}")
        data = os.read(fd, MAX_JOB_FILE + 1)
    except OSError as exc:
        raise BadJobFile(path, exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(data) > MAX_JOB_FILE:
        raise BadJobFile(path, f"is more than {MAX_JOB_FILE} bytes; a job file is at most that")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadJobFile(path, f"is not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadJobFile(path, f"is not valid TOML: {exc}") from None


def option_keys(command: click.Command) -> dict[str, click.Option]:
    """The keys a job file may have for `command` (long option names, `-` as `_`), and their options."""
    keys: dict[str, click.Option] = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in _NOT_KEYS:
            for opt in param.opts + param.secondary_opts:
                if opt.startswith("--"):
                    keys[opt[2:].replace("-", "_")] = param
    return keys


def job_defaults(command: click.Command, path: Path, data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The defaults the file gives `command`'s options (by parameter name), and its script with its
    arguments (empty: none); BadJobFile names a key that is unknown or of the wrong type."""
    keys = option_keys(command)
    defaults: dict[str, Any] = {}
    script: list[str] = []
    args: list[str] = []
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key == "script":
            script = _strings(path, raw_key, value, allow_one=True)
            continue
        if key == "args":
            args = _strings(path, raw_key, value, allow_one=False)
            continue
        param = keys.get(key)
        if param is None:
            known = sorted({k.replace("_", "-") for k in keys} | set(SCRIPT_KEYS))
            near = difflib.get_close_matches(raw_key.replace("_", "-"), known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(known)}"
            raise BadJobFile(path, f"unknown key {raw_key!r}{hint}")
        assert param.name is not None
        defaults[param.name] = _value(path, raw_key, param, value)
    if args and not script:
        raise BadJobFile(path, "'args' needs a 'script'")
    return defaults, script + args


def _strings(path: Path, key: str, value: Any, *, allow_one: bool) -> list[str]:
    if allow_one and isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    what = "a string or a list of strings" if allow_one else "a list of strings"
    raise BadJobFile(path, f"{key!r} must be {what}, got {_shown(value)}")


def _value(path: Path, key: str, param: click.Option, value: Any) -> Any:
    """`value` checked against the option's type, in the form click takes as a default."""
    if param.multiple:
        if isinstance(value, dict) and param.name in _TABLES:
            return [f"{k}={_text(path, f'{key}.{k}', v)}" for k, v in value.items()]
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        table = " or a table" if param.name in _TABLES else ""
        raise BadJobFile(path, f"{key!r} must be a string, a list of strings{table}, got {_shown(value)}")
    if param.is_flag:
        if not isinstance(value, bool):
            raise BadJobFile(path, f"{key!r} must be true or false, got {_shown(value)}")
        return value
    kind = param.type
    if isinstance(kind, click.types.IntParamType):
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadJobFile(path, f"{key!r} must be an integer, got {_shown(value)}")
        return value
    if isinstance(kind, click.types.FloatParamType):
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise BadJobFile(path, f"{key!r} must be a number, got {_shown(value)}")
        return float(value)
    if not isinstance(value, str):
        raise BadJobFile(path, f"{key!r} must be a string, got {_shown(value)}")
    if isinstance(kind, click.Choice) and value not in kind.choices:
        raise BadJobFile(path, f"{key!r} must be one of {', '.join(map(str, kind.choices))}, got {value!r}")
    return value


def _text(path: Path, key: str, value: Any) -> str:
    """A table entry as the K=V text of the command line (true/false, numbers as written)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise BadJobFile(path, f"{key!r} must be a string, a number or true/false, got {_shown(value)}")


def _shown(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a table"}
    text = repr(value)
    return f"{kinds.get(type(value), type(value).__name__)} ({text[:60]}{'...' if len(text) > 60 else ''})"
