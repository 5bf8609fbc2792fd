"""Which pooled interpreters may serve which job, and how many of each to keep (pure logic).

A pooled interpreter can become a rank of a job only where a cold start of that rank would have
been the same process up to its assignment: started as the same user, by the same interpreter of
the same environment (a venv's ``bin``), with the same value of every variable read while the
interpreter, libc, the OpenMP/BLAS runtimes and torch start (`startup_var`). Those three make its
`PoolKey`; the rest of the job's environment, its working directory and its cgroup are applied
on assignment (`launch`), so the rank is then the cold start it stands in for.

The pool learns keys from the jobs it sees (`Demand`: the key's `Shape`, the ranks of its last
job, when it was last used) and `plan` sizes it:

- a key wants ``min(per_key, 2 x ranks of its last job)`` interpreters: enough for the next job of
  the shape and the one after it, so back-to-back jobs stay warm while the pool refills (a refill
  imports torch, seconds of CPU, and starts only once the job that took the workers has ended);
- all keys together hold at most ``total``: the keys used most recently are served first, so a
  key just used takes the room of idle interpreters of the key used longest ago;
- but per user: each user with a live key keeps at least one warm interpreter (its latest key's),
  and no user holds more than an even share of ``total`` (``total // users``, at least one), so
  one user cycling new keys evicts only its own interpreters, never another user's;
- a key unused for ``idle_expiry`` seconds is forgotten and its interpreters retired.

Nothing here does I/O or reads a clock (`plan` takes ``now``); `pool_env` and `own_shape` read
this process's environment and uid. Which jobs may use the pool at all: `pool_eligible`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...protocol import JobSpec
from ...protocol.worker import is_reserved_env
from ..config import Config
from ..contain.identity import Identity, job_environment, submitted_environment

# Variables read when the interpreter, libc, the OpenMP/BLAS runtimes or torch (and the modules a
# pool worker pre-imports, e.g. torch._dynamo's config) start: a warm interpreter has already read
# them. Not in the list, so applied on assignment: CUDA_* (CUDA is initialised lazily, after the
# assignment), NCCL_* and GLOO_* (read when a communicator is created), OMP_NUM_THREADS (applied
# with torch.set_num_threads), MASTER_*, RANK... HOME decides the user's site-packages directory.
COLD_ENV_PREFIXES = (
    "PYTHON", "LD_", "MALLOC_", "GLIBC_", "TORCH", "PYTORCH_", "OMP_", "GOMP_", "KMP_", "MKL_",
    "OPENBLAS_", "LC_", "LANG",
)
POOL_SAFE_ENV = frozenset({"OMP_NUM_THREADS"})
STARTUP_EXACT = frozenset({"HOME"})
UNKEYED = frozenset({"PYTHONUNBUFFERED"})  # every pooled interpreter starts unbuffered
# besides the start-up variables, what a pooled interpreter starts with (the rest comes on assignment)
START_KEEP = ("PATH", "USER", "LOGNAME", "SHELL", "TMPDIR")
SYSTEMD_ENV = ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")


def startup_var(name: str) -> bool:
    """Whether `name` is read at interpreter or torch start (a pooled rank has read it already)."""
    return name in STARTUP_EXACT or (name.startswith(COLD_ENV_PREFIXES) and name not in POOL_SAFE_ENV)


def keyed_var(name: str) -> bool:
    """Whether `name`'s value is part of a `PoolKey` (a start-up variable other than `UNKEYED`)."""
    return startup_var(name) and name not in UNKEYED


def interpreter_id(python: str) -> tuple[str, str]:
    """The same interpreter of the same environment: the resolved directory of the name (a venv's
    ``bin``) and the resolved file. Two venvs over one base interpreter differ."""
    return os.path.realpath(os.path.dirname(python)), os.path.realpath(python)


@dataclass(frozen=True)
class PoolKey:
    """The user, interpreter and start-up environment a pooled interpreter was started with."""

    uid: int
    interpreter: tuple[str, str]
    startup: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, uid: int, python: str, env: Mapping[str, str]) -> PoolKey:
        return cls(uid, interpreter_id(python), tuple(sorted((k, v) for k, v in env.items() if keyed_var(k))))

    def label(self) -> str:
        """For logs: the uid and interpreter, never an environment value."""
        return f"uid {self.uid} {self.interpreter[1]}"


def start_env(base: Mapping[str, str]) -> dict[str, str]:
    """What a pooled interpreter for a job whose ranks start from `base` is started with: the
    start-up variables and the identity, unbuffered output, and one intra-op thread (torch must not
    size its pool to every core before the rank's count is known; the rank raises it on assignment)."""
    env = {k: v for k, v in base.items() if keyed_var(k) or k in START_KEEP}
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass(frozen=True)
class Shape:
    """How to start a pooled interpreter of one key: argv prefix, environment, user, directory."""

    key: PoolKey
    argv: tuple[str, ...]  # the interpreter and ``-m ddpd.worker``; worker_args are appended
    env: Mapping[str, str]
    identity: Identity | None  # the user to start it as, through the gate; None: the daemon's own user
    cwd: str


def pool_eligible(spec: JobSpec) -> str | None:
    """None when the job's ranks may be pooled workers, else why they must start cold."""
    for key in spec.env:
        if key in STARTUP_EXACT or (key not in POOL_SAFE_ENV and key.startswith(COLD_ENV_PREFIXES)):
            return f"spec.env sets {key}, read at interpreter or torch start"
    return None


def pool_env() -> dict[str, str]:
    """The daemon's environment less systemd's variables: what a job from a client that sends no
    environment starts from."""
    env = dict(os.environ)
    for key in SYSTEMD_ENV:
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def base_env(environ: Mapping[str, str] | None, identity: Identity) -> dict[str, str]:
    """What a rank's (or a rendezvous agent's) environment starts from: the submitter's exported
    variables `environ` (reserved names dropped) and the passwd identity; for a client that sent
    none, the passwd entry's variables and a sane PATH (`submitted_environment`), or the daemon's own
    (`pool_env`) for the daemon's own user."""
    if environ is None and identity.uid == os.geteuid():
        return pool_env()
    if environ is None:  # never the root daemon's own environment: the passwd entry's
        return {**job_environment(identity, submitted_environment(identity, None), {}, {}), "PYTHONUNBUFFERED": "1"}
    exported = {k: v for k, v in environ.items() if not is_reserved_env(k)}
    return job_environment(identity, exported, {}, {})


def own_shape(config: Config) -> Shape:
    """The daemon's own key: its user, its worker interpreter, its environment."""
    argv = config.worker_command or (sys.executable, "-m", "ddpd.worker")
    env = start_env(pool_env())
    return Shape(key=PoolKey.of(os.geteuid(), argv[0], env), argv=tuple(argv), env=env, identity=None,
                 cwd=str(config.state_dir))


@dataclass
class Demand:
    """What the pool knows of one key: its shape, the ranks its last job had, when it was last used."""


    shape: Shape
    ranks: int
    last_used: float


@dataclass(frozen=True)
class Plan:
    """`spawn`: how many to start per key; `retire`: how many idle ones to end per key; `forget`:
    keys whose demand expired (their interpreters are all retired)."""

    spawn: dict[PoolKey, int] = field(default_factory=dict)
    retire: dict[PoolKey, int] = field(default_factory=dict)
    forget: tuple[PoolKey, ...] = ()


def plan(demand: Mapping[PoolKey, Demand], held: Mapping[PoolKey, int], *, total: int, per_key: int,
         idle_expiry: float, now: float) -> Plan:
    """What to spawn and retire so each key holds its share (see the module docstring).

    `held` counts each key's interpreters ready or starting (keys absent from `demand`, e.g. just
    forgotten, are retired entirely).
    """
    forget = tuple(k for k, d in demand.items() if now - d.last_used >= idle_expiry)
    live = sorted((d for k, d in demand.items() if k not in forget), key=lambda d: -d.last_used)
    share = _shares(live, max(0, total), max(0, per_key))
    spawn = {k: n - held.get(k, 0) for k, n in share.items() if n > held.get(k, 0)}
    retire = {k: h - share.get(k, 0) for k, h in held.items() if h > share.get(k, 0)}
    return Plan(spawn=spawn, retire=retire, forget=forget)


def _shares(live: list[Demand], room: int, per_key: int) -> dict[PoolKey, int]:
    """Each key's share, `live` most recently used first: each user's latest key one interpreter
    first, then each key its want within its user's even share of the pool (at least one)."""
    users = list(dict.fromkeys(d.shape.key.uid for d in live))
    cap = max(1, room // len(users)) if users else 0
    share: dict[PoolKey, int] = {}
    per_user: dict[int, int] = {}
    for d in live:  # one warm interpreter for each active user, while the pool has room
        uid = d.shape.key.uid
        if uid not in per_user and room > 0 and min(per_key, 2 * max(0, d.ranks)) > 0:
            share[d.shape.key], per_user[uid], room = 1, 1, room - 1
    for d in live:
        uid, key = d.shape.key.uid, d.shape.key
        more = min(room, min(per_key, 2 * max(0, d.ranks)) - share.get(key, 0), cap - per_user.get(uid, 0))
        if more > 0:
            share[key] = share.get(key, 0) + more
            per_user[uid] = per_user.get(uid, 0) + more
            room -= more
    return share


def next_expiry(demand: Mapping[PoolKey, Demand], idle_expiry: float) -> float | None:
    """When the next key's demand expires (monotonic seconds), None with no demand."""
    return min((d.last_used + idle_expiry for d in demand.values()), default=None)


CLAIM_WAIT = 30.0  # seconds a job's claim on its key's ready interpreters lasts (its takes come within them)


class Claims:
    """Ranks a starting job will take, per key, for CLAIM_WAIT seconds after its start: what the
    refill loop must not retire as surplus when the start lowered its key's want (it did, and a
    1-rank job after a 2-rank one started cold). Each take uses one; a claim no take follows (a
    launch that failed before its ranks) lapses."""

    def __init__(self) -> None:
        self._claims: dict[PoolKey, tuple[int, float]] = {}

    def claim(self, key: PoolKey, ranks: int, now: float) -> None:
        self._claims[key] = (ranks, now + CLAIM_WAIT)

    def took(self, key: PoolKey) -> None:
        ranks, until = self._claims.get(key, (0, 0.0))
        self._claims[key] = (max(0, ranks - 1), until)

    def held(self, key: PoolKey, now: float) -> int:
        ranks, until = self._claims.get(key, (0, 0.0))
        return ranks if now < until else 0

    def forget(self, key: PoolKey) -> None:
        self._claims.pop(key, None)
