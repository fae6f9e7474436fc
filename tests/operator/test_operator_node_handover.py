"""Issue 43, the node agent against a tenant's files: a root pod of a `baseline` namespace can
mount its namespace's claim, fill `cache/` and take it back, so the agent's next hand-over walks
a tree the tenant wrote. It removes device nodes, fifos and sockets instead of giving them away,
clears set-ID bits, follows no link, walks a million files in the memory of ten (tracemalloc,
not a timing), and works on one namespace without holding any other. At its start it checks the
cache filesystem's mount options, and it sets a namespace's project quota where the filesystem
keeps them: both on real loop-mounted ext4 filesystems where this machine can make them.
Tests run as root here, so chown and mknod work as they do in the agent's container."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dlo_operator import node_directories
from dlo_operator.node_agent import check_mount
from dlo_operator.node_directories import prepare
from dlo_operator.node_filesystem import (
    QuotaUnavailable,
    mount_of,
    parse_mountinfo,
    project_id,
    set_block_limit,
    set_project_quota,
)
from dlo_operator.node_handover import MAX_DEPTH, Owner

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown and mknod need root")

LOADER = Owner(65532, 65532)
MANY_FILES = 100_000
PEAK_BOUND = 1 << 20
"""Bytes of Python heap a hand-over of `MANY_FILES` may peak at: a walk that lists a directory
holds about 100 bytes per name (10 MB here); the streamed one holds a few kilobytes."""


def taken_back_cache(root: Path, namespace: str = "team-a") -> Path:
    """A namespace's directory whose `cache/` a root pod took back: the next prepare hands it
    over to the loader again."""
    root.mkdir(exist_ok=True)
    assert prepare(str(root), namespace, LOADER) is True
    cache = root / "namespaces" / namespace / "cache"
    os.chown(cache, 0, 0)
    return cache


def test_device_nodes_fifos_and_sockets_are_removed_never_given(tmp_path: Path) -> None:
    cache = taken_back_cache(tmp_path)
    (cache / "v1").mkdir()
    planted = {"block": stat.S_IFBLK | 0o666, "char": stat.S_IFCHR | 0o666,
               "fifo": stat.S_IFIFO | 0o666, "socket": stat.S_IFSOCK | 0o666}
    for name, mode in planted.items():
        os.mknod(cache / "v1" / name, mode, os.makedev(7, 0))
    (cache / "v1" / "weights.bin").write_bytes(b"w")
    prepare(str(tmp_path), "team-a", LOADER)
    assert sorted(os.listdir(cache / "v1")) == ["weights.bin"]
    info = os.lstat(cache / "v1" / "weights.bin")
    assert (info.st_uid, info.st_gid) == (65532, 65532)


def test_set_id_bits_are_cleared_on_everything_given(tmp_path: Path) -> None:
    """chown alone clears set-user-ID on an executable file; set-group-ID on a file without
    group execute and on a directory survive it."""
    cache = taken_back_cache(tmp_path)
    modes = {"setuid-program": 0o4755, "setgid-no-exec": 0o2644, "setgid-dir": 0o2755}
    for name, mode in modes.items():
        path = cache / name
        path.mkdir() if name.endswith("dir") else path.write_bytes(b"x")
        path.chmod(mode)
    prepare(str(tmp_path), "team-a", LOADER)
    for name, mode in modes.items():
        info = os.lstat(cache / name)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (65532, mode & 0o777), name


def test_a_symlink_is_neither_followed_nor_given(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    cache = taken_back_cache(root)
    (cache / "to-file").symlink_to(outside / "secret")
    (cache / "to-dir").symlink_to(outside, target_is_directory=True)
    prepare(str(root), "team-a", LOADER)
    for path in (cache / "to-file", cache / "to-dir", outside, outside / "secret"):
        assert os.lstat(path).st_uid == 0, path
    assert os.readlink(cache / "to-file") == str(outside / "secret")


@pytest.fixture
def memory_directory(tmp_path: Path) -> Iterator[Path]:
    """A directory in memory where the machine has one (/dev/shm): made on a disk, the files
    take most of the test's time; the walk is the same."""
    if not os.path.isdir("/dev/shm"):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        yield Path(directory)


def test_a_hand_over_of_many_files_keeps_its_memory_bounded(memory_directory: Path) -> None:
    cache = taken_back_cache(memory_directory)
    flat = cache / "v1" / "flat"
    flat.mkdir(parents=True)
    flat_fd = os.open(flat, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for index in range(MANY_FILES):
            os.close(os.open(f"f{index}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=flat_fd))
    finally:
        os.close(flat_fd)
    tracemalloc.start()
    try:
        prepare(str(memory_directory), "team-a", LOADER)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BOUND, peak
    with os.scandir(flat) as entries:
        owners = {entry.stat(follow_symlinks=False).st_uid for entry in entries}
    assert owners == {65532}


def test_directories_deeper_than_the_walk_are_left(tmp_path: Path) -> None:
    cache = taken_back_cache(tmp_path)
    deep = cache.joinpath(*[f"d{level}" for level in range(MAX_DEPTH + 2)])
    deep.mkdir(parents=True)
    prepare(str(tmp_path), "team-a", LOADER)
    last_given = cache.joinpath(*[f"d{level}" for level in range(MAX_DEPTH)])
    assert os.lstat(last_given).st_uid == 65532
    assert os.lstat(last_given / f"d{MAX_DEPTH}").st_uid == 0


def test_one_namespace_is_prepared_while_another_is_held(tmp_path: Path) -> None:
    """No lock is global: with team-a's held (a long hand-over), team-b is prepared."""
    with node_directories._lock_of("team-a"):
        assert prepare(str(tmp_path), "team-b", LOADER) is True
    assert node_directories._lock_of("team-a") is not node_directories._lock_of("team-b")


MOUNTINFO = (
    "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    "45 22 7:0 / /var/lib/dlo rw,nosuid,nodev,relatime shared:1 - ext4 /dev/loop0 rw\n"
    "46 22 7:1 / /var/lib/dlo\\040two rw,nosuid,nodev,noexec - xfs /dev/loop1 rw,prjquota\n")


def test_the_mount_holding_the_root_is_read_from_mountinfo() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert mount_of("/var/lib/dlo/namespaces", mounts).point == "/var/lib/dlo"
    assert mount_of("/var/lib/dlo-evil", mounts).point == "/"
    two = mount_of("/var/lib/dlo two/x", mounts)
    assert (two.point, two.fstype, "prjquota" in two.options) == ("/var/lib/dlo two", "xfs", True)
    assert "noexec" not in mount_of("/var/lib/dlo", mounts).options


@pytest.fixture
def loop_ext4(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mount a fresh ext4 image with the given options; skips where this machine cannot."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("no mkfs.ext4")
    mounted: list[Path] = []

    def mount(options: str, features: tuple[str, ...] = ()) -> Path:
        image, point = tmp_path / f"fs{len(mounted)}.img", tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        with open(image, "wb") as file:
            file.truncate(32 << 20)
        made = [f"-O{','.join(features)}"] if features else []
        subprocess.run(["mkfs.ext4", "-q", *made, str(image)], check=True)
        done = subprocess.run(["mount", "-o", f"loop,{options}", str(image), str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"the kernel refused to mount ext4 -o {options}: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


def test_the_agent_warns_of_a_cache_filesystem_without_nosuid_nodev_noexec(
        loop_ext4: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    safe, unsafe = loop_ext4("nosuid,nodev,noexec"), loop_ext4("nosuid")
    caplog.set_level(logging.WARNING, logger="dlo_operator.node_agent")
    assert check_mount(str(safe)) == ()
    assert caplog.messages == []
    assert check_mount(str(unsafe / "namespaces")) == ("nodev", "noexec")
    assert caplog.messages == [
        f"the node cache {unsafe}/namespaces is on {unsafe} (ext4) mounted without nodev,noexec: "
        "a file a pod writes there could be a device it opens, a set-user-ID program or code it "
        "runs (the agent removes device nodes and clears set-ID bits only when it hands a tree "
        "over); mount that filesystem with nosuid,nodev,noexec, e.g. a disk of its own with "
        "those options in /etc/fstab"]


def test_a_namespace_gets_its_project_quota_on_a_filesystem_that_keeps_them(
        loop_ext4: Callable[..., Path]) -> None:
    root = loop_ext4("prjquota,nosuid,nodev,noexec", ("quota", "project"))
    assert prepare(str(root), "team-a", LOADER, quota_bytes=1 << 20) is True
    cache = root / "namespaces" / "team-a" / "cache"
    fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert set_project_quota(fd, "team-a", 1 << 20) == project_id("team-a")
    finally:
        os.close(fd)
    # Written by a process of the loader's user (root with CAP_SYS_RESOURCE passes a quota).
    fd = os.open(cache / "big", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        write = subprocess.run(["head", "-c", str(2 << 20), "/dev/zero"], stdout=fd,
                               stderr=subprocess.PIPE, text=True, user=LOADER.uid,
                               group=LOADER.gid)
    finally:
        os.close(fd)
    assert write.returncode != 0
    assert os.strerror(errno.EDQUOT) in write.stderr
    assert os.stat(cache / "big").st_size <= 1 << 20


def test_a_filesystem_without_project_ids_is_refused_at_the_syscall_and_logged(
        loop_ext4: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    """A real FS_IOC_FSSETXATTR on ext4 without the `project` feature: the kernel refuses it (or
    keeps project 0, which the agent reads back); the directory is prepared without a quota."""
    root = loop_ext4("nosuid,nodev,noexec")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(QuotaUnavailable) as refused:
            set_project_quota(fd, "team-a", 1 << 20)
    finally:
        os.close(fd)
    assert str(refused.value) in (  # kernels differ: a refusal, or project 0 kept
        "the cache filesystem refused project ids (FS_IOC_FSSETXATTR): not supported",
        "the cache filesystem keeps no project id (ext4 without the project feature)")
    caplog.set_level(logging.WARNING, logger="dlo_operator.node_directories")
    assert prepare(str(root), "team-a", LOADER, quota_bytes=1 << 20) is True
    assert caplog.messages == [f"{root}/namespaces/team-a: no quota of 1048576 bytes: "
                               f"{refused.value} (hint: {refused.value.hint})"]
    assert os.lstat(root / "namespaces" / "team-a" / "cache").st_uid == 65532


def test_the_quota_call_reaches_the_kernel_and_its_refusal_is_named(
        loop_ext4: Callable[..., Path]) -> None:
    """A real quotactl_fd(Q_SETQUOTA, PRJQUOTA) on a filesystem without quotas: the kernel
    parses the call and answers that quotas are off (ENOSYS on a kernel before 5.14)."""
    root = loop_ext4("nosuid,nodev,noexec")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(QuotaUnavailable) as refused:
            set_block_limit(fd, project_id("team-a"), 1 << 20)
    finally:
        os.close(fd)
    assert str(refused.value) in (
        "the cache filesystem refused project quotas (quotactl_fd): project quotas are not on "
        "for this mount",
        "the cache filesystem refused project quotas (quotactl_fd): the kernel has no "
        "quotactl_fd (Linux 5.14+)")
