"""Whose a run's record is. A verb that names a run (`stop`, `attach`, `stacks`, `status`, `top`, `logs`, `report`)
believes a record only when the caller owns its folder and every file in it, and nobody else could have put it there
or changed it: not through its runs directory (writable by the caller alone, unless it is shared with a group on
purpose: HARNESS_RUNS_GROUP) nor through a directory above it (the caller's or root's). Root is held to the same rule:
a record another user planted names the processes that root's `stop` would signal and the spec `attach` would load.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Mapping
from pathlib import Path

from harness.errors import UsageError, short_repr

SHARED_GROUP = "HARNESS_RUNS_GROUP"  # a runs directory of this group is shared with it on purpose (docs/cli.md)
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def shared_group(environ: Mapping[str, str] = os.environ) -> int | None:
    """The gid HARNESS_RUNS_GROUP names (a group name or id); None when unset."""
    name = environ.get(SHARED_GROUP, "")
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
    raise UsageError(f"{SHARED_GROUP}={short_repr(name)} names no group of this machine: expected the name or id of "
                     f"the group the runs directory is shared with (`getent group`), or leave it unset")


def shared_with(runs_dir: os.stat_result, environ: Mapping[str, str] = os.environ) -> int | None:
    """The group a runs directory is shared with on purpose: its own group, when HARNESS_RUNS_GROUP names it."""
    gid = shared_group(environ)
    return gid if gid is not None and runs_dir.st_gid == gid else None


def owned_by_caller(path: Path) -> bool:
    """Whether path (followed where it is a link: an index entry) is the caller's; False where it is gone."""
    try:
        return path.stat().st_uid == os.geteuid()
    except OSError:
        return False


def user_words(uid: int) -> str:
    """`mallory (uid 12345)`, or `uid 12345` for a uid without a name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def group_words(gid: int) -> str:
    try:
        return f"group {grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"group {gid}"


def _callers_own_group(gid: int) -> bool:
    """A group that is the caller's alone: the user private group that umask-002 systems give each user (named as
    the user, no other member). Its write bit lets nobody else in."""
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return group.gr_name == user and set(group.gr_mem) <= {user}


def writable_by_others(info: os.stat_result, shared_gid: int | None = None) -> str | None:
    """Who besides the caller may write what info describes, in words (None: nobody). A sticky directory lets others
    add entries but not replace or remove the caller's; a group shared with on purpose, or the caller's own, counts
    as no one else."""
    if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX:
        return None
    if info.st_mode & stat.S_IWOTH:
        return "every user"
    if info.st_mode & stat.S_IWGRP and info.st_gid != shared_gid and not _callers_own_group(info.st_gid):
        return group_words(info.st_gid)
    return None


def check_runs_dir(runs_dir: Path) -> None:
    """UsageError, in one line, unless runs_dir is a place only the caller (and a group it is shared with on purpose)
    can change: the directories above it the caller's or root's, itself the caller's or root's and writable by no one
    else. Where it is shared on purpose, any member may own it and the group may write it."""
    real = Path(os.path.realpath(runs_dir))
    uid = os.geteuid()
    for above in reversed(real.parents):
        info = os.stat(above)
        if info.st_uid not in (uid, 0):
            raise UsageError(f"{above} is owned by {user_words(info.st_uid)}, who could replace the runs directory "
                             f"{runs_dir} under it with runs of their own; keep your runs under a directory of yours "
                             f"(--runs-dir or HARNESS_RUNS_DIR)")
    info = os.stat(real)
    shared = shared_with(info)
    if shared is None and info.st_uid not in (uid, 0):
        raise UsageError(f"the runs directory {runs_dir} is owned by {user_words(info.st_uid)}, not by you; keep your "
                         f"runs in a directory of yours (--runs-dir or HARNESS_RUNS_DIR), or set {SHARED_GROUP} to its "
                         f"group if it is shared with that group on purpose (docs/cli.md)")
    if (who := writable_by_others(info, shared)) is not None:
        fix = f"`chmod o-w {runs_dir}`, or `chmod +t` as /tmp is" if who == "every user" else \
            f"`chmod g-w {runs_dir}`, or set {SHARED_GROUP} to its group if it is shared with that group on purpose"
        raise UsageError(f"the runs directory {runs_dir} (mode {stat.S_IMODE(info.st_mode):04o}) may be written by "
                         f"{who}, who could put a run of theirs there or replace yours: {fix} (docs/cli.md)")


def check_run_folder(folder: Path, run_id: str) -> None:
    """UsageError, in one line, unless the run's folder and every file in it are the caller's and no one else can
    write them, in a runs directory that passes check_runs_dir: what every verb that names a run believes."""
    real = Path(os.path.realpath(folder))
    info = os.stat(real)
    _check_own(run_id, real, info)
    check_runs_dir(real.parent)
    if (who := writable_by_others(info)) is not None:
        raise UsageError(f"run {run_id}: its folder {folder} (mode {stat.S_IMODE(info.st_mode):04o}) may be written "
                         f"by {who}, who could have changed its record; `chmod go-w {folder}` if nobody did")
    opened = info.st_mode & (stat.S_IXGRP | stat.S_IXOTH)  # others may reach its files: closed to them too
    for parent, folders, files in os.walk(real):
        for name in [*folders, *files]:
            path = Path(parent, name)
            try:
                entry = os.lstat(path)
            except FileNotFoundError:  # a temporary file renamed meanwhile
                continue
            _check_own(run_id, path, entry)
            if opened and not stat.S_ISLNK(entry.st_mode) and (who := writable_by_others(entry)) is not None:
                raise UsageError(f"run {run_id}: {path} (mode {stat.S_IMODE(entry.st_mode):04o}) may be written by "
                                 f"{who}, who could have changed it; `chmod go-w {path}` if nobody did")


def _check_own(run_id: str, path: Path, info: os.stat_result) -> None:
    if info.st_uid != os.geteuid():
        raise UsageError(f"run {run_id} is not yours: {path} is owned by {user_words(info.st_uid)}, not by you "
                         f"({user_words(os.geteuid())}); harness acts only on runs of your own (their owner may act "
                         f"on it, e.g. `sudo -u {_name(info.st_uid)} harness ...`)")


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"#{uid}"
