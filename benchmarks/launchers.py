"""torchrun and mp.spawn running benchmarks/ddp_script.py: one run's process, its per-rank stamps
(the times each rank wrote) and its log."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import anyio
import anyio.abc
import msgspec

from .common import DDP_SCRIPT, PYTHON, SPAWN, TORCHRUN, TORCHRUN_NAME, BenchError, free_port


@dataclass
class LauncherRun:
    """One run of the standalone script under torchrun or mp.spawn."""

    kind: str
    proc: anyio.abc.Process
    stamps: Path
    log_path: Path
    t0: float  # perf_counter just before the launcher was started
    t0_wall: float  # time.time() at the same moment

    def read_stamps(self) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for path in self.stamps.glob("rank-*.json"):
            try:
                data = msgspec.json.decode(path.read_bytes())
            except (OSError, msgspec.DecodeError):
                continue
            out[int(data["rank"])] = data
        return out

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def wait_stamps(self, nproc: int, key: str, timeout: float = 300.0) -> dict[int, dict[str, Any]]:
        """Poll the rank files until every rank has written `key` (the launcher must stay alive)."""
        with anyio.fail_after(timeout):
            while True:
                stamps = self.read_stamps()
                if len(stamps) == nproc and all(key in s for s in stamps.values()):
                    return stamps
                if self.proc.returncode is not None:
                    raise BenchError(f"{self.kind} exited with {self.proc.returncode}:\n{self.log_tail()}")
                await anyio.sleep(0.02)

    def kill(self) -> None:
        """The launcher's session (it was started in a new one) and every rank it wrote down."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for s in self.read_stamps().values():
            try:
                os.kill(int(s["pid"]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def open_log(path: Path) -> BinaryIO:
    return open(path, "ab")  # closed by the caller once the child has it


async def start_launcher(kind: str, base: Path, script_args: Sequence[str], nproc: int = 2,
                         extra: Sequence[str] = ()) -> LauncherRun:
    """torchrun (with `extra` flags of its own) or mp.spawn running ddp_script.py with `script_args`."""
    run_dir = Path(tempfile.mkdtemp(prefix=kind.replace(".", "") + "-", dir=base))
    stamps = run_dir / "stamps"
    log_path = run_dir / "launcher.log"
    port = free_port()
    env = dict(os.environ)
    if kind == TORCHRUN_NAME:
        argv = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
                *extra, DDP_SCRIPT, "--stamps", str(stamps), *script_args]
    elif kind == SPAWN:
        argv = [PYTHON, DDP_SCRIPT, "--spawn", str(nproc), "--stamps", str(stamps), *script_args]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    else:
        raise ValueError(kind)
    log = open_log(log_path)
    try:
        t0_wall, t0 = time.time(), time.perf_counter()
        proc = await anyio.open_process(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                        cwd=str(run_dir), start_new_session=True)
    finally:
        log.close()
    return LauncherRun(kind, proc, stamps, log_path, t0, t0_wall)
