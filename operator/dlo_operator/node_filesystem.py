"""The node cache's filesystem as the node agent sees it: its mount options and project quotas.

[Note: the cache filesystem] Tenants write the node cache (a namespace's loader, and any root pod
of the namespace that mounts its claim), so the filesystem under `nodeCache.hostPath` should be
mounted `nosuid,nodev,noexec`: a file written there is then never a device the kernel opens, a
set-user-ID program, nor code the kernel runs. `missing_mount_options` reads the agent's own
`/proc/self/mountinfo` (the mount holding the root, its per-mount and superblock options) at the
agent's start; the agent warns, naming what is missing and the fix, and goes on (it still
removes device nodes and clears set-ID bits on every tree it hands over, `node_handover`):
refusing would keep every DOD pod of the node from starting over a node setting.

Where the filesystem keeps project quotas (XFS, or ext4 with the `project,quota` features,
mounted `prjquota`), `set_project_quota` gives a namespace's directory a project id of its own,
inherited by everything made below it (FS_IOC_FSSETXATTR with FS_XFLAG_PROJINHERIT), and a
hard block limit (quotactl_fd, Q_SETQUOTA of PRJQUOTA): chart value
`nodeCache.namespaceQuotaBytes`. Files that were there before keep their project (0). Setting a
quota needs CAP_SYS_ADMIN, which the chart adds only when the value is set. A filesystem or kernel
without them refuses with an errno, which becomes `QuotaUnavailable` naming why. Called by
`node_agent` and `node_directories`; it must not talk to the cluster.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import re
import struct
from dataclasses import dataclass

from dlo_operator.errors import OperatorError
from dlo_operator.host_paths import within

REQUIRED_MOUNT_OPTIONS = ("nosuid", "nodev", "noexec")
MOUNTINFO = "/proc/self/mountinfo"
FS_IOC_FSGETXATTR = 0x801C581F
"""_IOR('X', 31, struct fsxattr)."""
FS_IOC_FSSETXATTR = 0x401C5820
"""_IOW('X', 32, struct fsxattr)."""
FS_XFLAG_PROJINHERIT = 0x200
FSXATTR = struct.Struct("=IIIII8s")
"""struct fsxattr: xflags, extsize, nextents, projid, cowextsize, 8 bytes of padding."""
SYS_QUOTACTL_FD = 443
"""quotactl_fd(2), Linux 5.14, the same number on x86_64 and arm64: it takes a descriptor on the
filesystem, so the agent needs no block device node."""
Q_SETQUOTA = 0x800008
PRJQUOTA = 2
QIF_BLIMITS = 1
QUOTA_BLOCK = 1024
"""dqb_bhardlimit counts blocks of QIF_DQBLKSIZE bytes."""
DQBLK = struct.Struct("=QQQQQQQQI4x")
"""struct if_dqblk: bhardlimit, bsoftlimit, curspace, ihardlimit, isoftlimit, curinodes, btime,
itime, valid (padded to 8 bytes)."""


_OCTAL = re.compile(r"\\([0-7]{3})")
"""mountinfo writes a space, tab, newline or backslash of a path as a backslash and 3 octal
digits."""


class QuotaUnavailable(OperatorError):
    """The cache filesystem keeps no project quota here; the directory is made without one."""


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo: where it is mounted, its filesystem and every option it holds."""

    point: str
    fstype: str
    options: frozenset[str]


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in order (a later mount on one point hides the earlier)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])  # \040: a space
        options = {*fields[5].split(","), *fields[separator + 3].split(",")}
        mounts.append(Mount(point, fields[separator + 1], frozenset(options)))
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount:
    """The mount that holds `path`: the deepest mount point above it, the last one mounted."""
    holding = [m for m in mounts if within(path, m.point)]
    return max(reversed(holding), key=lambda m: len(m.point.rstrip("/").split("/")))


def missing_mount_options(path: str, mountinfo: str = MOUNTINFO) -> tuple[Mount, tuple[str, ...]]:
    """The mount holding `path` and which of `REQUIRED_MOUNT_OPTIONS` it lacks."""
    with open(mountinfo, encoding="utf-8") as source:
        mount = mount_of(path, parse_mountinfo(source.read()))
    return mount, tuple(o for o in REQUIRED_MOUNT_OPTIONS if o not in mount.options)


def project_id(namespace: str) -> int:
    """A namespace's project id: 31 bits of a digest of its name, never 0 (no project). Two
    namespaces share one with odds of about n^2 / 2^32 for n namespaces on a node."""
    digest = int.from_bytes(hashlib.sha256(namespace.encode()).digest()[:4], "big")
    return (digest & 0x7FFFFFFF) or 1


def set_project_quota(fd: int, namespace: str, limit_bytes: int) -> int:
    """Give the directory `fd` the namespace's project (inherited below it) and that project a
    hard limit of `limit_bytes`; the project id."""
    project = project_id(namespace)
    raw = bytearray(FSXATTR.size)
    try:
        fcntl.ioctl(fd, FS_IOC_FSGETXATTR, raw)
        xflags, extsize, nextents, _, cow, pad = FSXATTR.unpack(raw)
        fcntl.ioctl(fd, FS_IOC_FSSETXATTR, FSXATTR.pack(
            xflags | FS_XFLAG_PROJINHERIT, extsize, nextents, project, cow, pad))
        fcntl.ioctl(fd, FS_IOC_FSGETXATTR, raw)
    except OSError as exc:
        raise _unavailable("project ids (FS_IOC_FSSETXATTR)", exc) from exc
    if FSXATTR.unpack(raw)[3] != project:  # ext4 without the `project` feature keeps 0
        raise QuotaUnavailable("the cache filesystem keeps no project id (ext4 without the "
                               "project feature)", hint=_QUOTA_HINT)
    set_block_limit(fd, project, limit_bytes)
    return project


def set_block_limit(fd: int, project: int, limit_bytes: int) -> None:
    """Q_SETQUOTA of `project` on the filesystem of `fd`: a hard limit of `limit_bytes`, rounded
    up to whole quota blocks."""
    blocks = -(-limit_bytes // QUOTA_BLOCK)
    libc = ctypes.CDLL(None, use_errno=True)
    limits = ctypes.create_string_buffer(DQBLK.pack(blocks, 0, 0, 0, 0, 0, 0, 0, QIF_BLIMITS))
    command = (Q_SETQUOTA << 8) | PRJQUOTA
    if libc.syscall(ctypes.c_long(SYS_QUOTACTL_FD), ctypes.c_long(fd), ctypes.c_long(command),
                    ctypes.c_long(project), limits) != 0:
        code = ctypes.get_errno()
        raise _unavailable("project quotas (quotactl_fd)", OSError(code, os.strerror(code)))


_QUOTA_HINT = ("mount the cache filesystem with project quotas (XFS: prjquota; ext4: mkfs -O "
               "project,quota and mount -o prjquota) and give the agent CAP_SYS_ADMIN (the chart "
               "does when nodeCache.namespaceQuotaBytes is set), or set it to 0")
_WHY = {errno.ENOTTY: "the filesystem has no project ids", errno.EOPNOTSUPP: "not supported",
        errno.ESRCH: "project quotas are not on for this mount", errno.ENOSYS: "the kernel "
        "has no quotactl_fd (Linux 5.14+)", errno.EPERM: "the agent lacks CAP_SYS_ADMIN"}


def _unavailable(what: str, exc: OSError) -> QuotaUnavailable:
    why = _WHY.get(exc.errno or 0, exc.strerror or str(exc))
    return QuotaUnavailable(f"the cache filesystem refused {what}: {why}", hint=_QUOTA_HINT)
