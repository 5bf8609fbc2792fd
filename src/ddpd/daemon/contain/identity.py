"""Who a job runs as: the submitter's identity, the checks at the door, and how ranks take it on.

The uid comes from SO_PEERCRED on the control socket; everything else comes from the passwd and
group databases, never from the client: `Identity.of(uid)` looks up the passwd entry, the primary
gid and the supplementary groups (`os.getgrouplist`, what `initgroups` would set).

- A daemon running as root starts each rank as the submitter: `popen_kwargs(identity)` gives
  `subprocess.Popen` its `user=`, `group=`, `extra_groups=` and `umask=0o077`. A daemon that is not
  root cannot switch users, so it gets `{}` and `check_serves` lets only its own uid in.
- `job_environment` builds a rank's environment from what the submitter exported: HOME, USER,
  LOGNAME and SHELL from the passwd entry, the job's `--env` pairs on top, the daemon's reserved
  variables last (they always win). A submit that exported nothing (`environ` absent: an older
  client, a raw request) starts from `submitted_environment`: the passwd entry's variables and
  `SANE_PATH`, never the root daemon's own environment (its HOME, PATH, secrets); only the
  daemon's own user gets the daemon's environment.

`Identity.of` blocks (database lookups): call it via `anyio.to_thread.run_sync`. The rest is pure.
(The check that the job's interpreter runs as the submitter is `ddpd.daemon.control.interpreters`;
it starts as every helper process does, `ddpd.daemon.contain.helpers`.)
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SANE_PATH = "/usr/local/bin:/usr/bin:/bin"  # a submit without `environ`: what login(1) gives a user
RANK_UMASK = 0o077  # what ranks create is the submitter's alone unless they widen it themselves


class UnknownUser(LookupError):
    """A uid with no passwd entry: the daemon cannot run anything as it."""


@dataclass(frozen=True)
class Identity:
    """A submitter as the system knows it (passwd and group databases)."""

    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, the primary gid included, as initgroups sets them
    name: str
    home: str
    shell: str

    @classmethod
    def of(cls, uid: int) -> Identity:
        """The identity of `uid` (blocking: NSS may ask LDAP or sssd; call via anyio.to_thread)."""
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:
            raise UnknownUser(f"uid {uid} has no passwd entry; ddpd runs jobs only as known users") from None
        groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
        return cls(
            uid=uid,
            gid=entry.pw_gid,
            groups=groups,
            name=entry.pw_name,
            home=entry.pw_dir,
            shell=entry.pw_shell or "/bin/sh",
        )

    def identity_env(self) -> dict[str, str]:
        """HOME, USER, LOGNAME and SHELL from the passwd entry (not from what the client sent)."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "SHELL": self.shell}

    def group_names(self) -> list[str]:
        """The names of the supplementary groups, for messages (blocking, like `of`)."""
        names = []
        for gid in self.groups:
            try:
                names.append(grp.getgrgid(gid).gr_name)
            except KeyError:
                names.append(str(gid))
        return names


def popen_kwargs(identity: Identity, daemon_uid: int | None = None) -> dict[str, Any]:
    """Keyword arguments for `subprocess.Popen` that start the child as `identity`.

    Only a root daemon can switch users; any other daemon gets `{}` (it runs its own uid's jobs
    only, see `check_serves`). `daemon_uid` defaults to the effective uid of this process.
    """
    if (os.geteuid() if daemon_uid is None else daemon_uid) != 0:
        return {}
    return {
        "user": identity.uid,
        "group": identity.gid,
        "extra_groups": list(identity.groups),
        "umask": RANK_UMASK,
    }


def check_serves(daemon_uid: int, peer_uid: int, allow_root_jobs: bool) -> str | None:
    """Why a daemon running as `daemon_uid` will not take jobs from `peer_uid`, or None if it will."""
    if daemon_uid != 0 and peer_uid != daemon_uid:
        return (
            f"this ddpd runs as uid {daemon_uid} and serves that user only (a per-user daemon); "
            f"uid {peer_uid} needs its own daemon (systemctl --user start ddpd) or the system one"
        )
    if peer_uid == 0 and not allow_root_jobs:
        return "jobs of root (uid 0) are refused by this daemon's config (allow_root_jobs = false); submit as a user"
    return None


def admin_gid(group: str | None) -> int | None:
    """The gid of the config's admin group (blocking NSS lookup, like `Identity.of`); None if unset or unknown."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None


def may_see_detail(viewer: Identity, owner_uid: int, admin: int | None) -> bool:
    """Whether `viewer` may see a job's detail (spec, env, args, logs, events, stacks): its owner,
    root, or a member of the admin group. Everyone else sees that the job exists and nothing more.
    """
    return viewer.uid in (owner_uid, 0) or (admin is not None and admin in viewer.groups)


def job_environment(
    identity: Identity,
    exported: Mapping[str, str],
    extra: Mapping[str, str],
    reserved: Mapping[str, str],
) -> dict[str, str]:
    """A rank's environment: exported, then the passwd identity, then the job's pairs, then reserved."""
    env = dict(exported)
    env.update(identity.identity_env())
    env.update(extra)
    env.update(reserved)
    return env


def submitted_environment(identity: Identity, environ: Mapping[str, str] | None) -> dict[str, str]:
    """What the submitter exported: `environ`; without it, the passwd entry's variables and SANE_PATH
    (the daemon's own environment only for the daemon's own user: a per-user daemon, as before)."""
    if environ is not None:
        return dict(environ)
    if identity.uid == os.geteuid():
        return dict(os.environ)
    return {**identity.identity_env(), "PATH": SANE_PATH}
