"""Exclusive locks on a file name, held through an open file (`flock`): the kernel releases a
lock when its holder exits, however it exits, so no lock outlives the process that took it (on
NFS, once the server's lease on a lost client runs out). They do not work on object storage."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class LockHeld(Exception):
    """The lock is held by another process; `holder` is what it wrote into the lock file
    (empty if it has not yet)."""

    def __init__(self, path: Path, holder: str):
        self.path, self.holder = path, holder
        super().__init__(f"{path} is locked by {self.who}")

    @property
    def who(self) -> str:
        """The holder as it wrote itself into the file, or what it is before it has."""
        return self.holder or "a process that has just started"


class LockRefused(Exception):
    """The lock's name is taken by something other than a regular file (a symbolic link, a
    directory, a FIFO, ...): it is neither followed nor written; the message says what and
    the fix."""


def _open_lock(path: Path) -> int:
    """The lock file's descriptor, opened for reading and writing and created if missing,
    never through a symbolic link (a link planted in its place would have its target
    truncated) and never anything but a regular file (LockRefused)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LockRefused(f"{path} is a symbolic link, which a lock file is never: "
                              "remove it and run again") from None
        if exc.errno == errno.EISDIR:
            raise LockRefused(f"{path} is a directory, where a lock file belongs: remove it "
                              "and run again") from None
        raise
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        raise LockRefused(f"{path} is not a regular file (a {_KINDS.get(kind, 'special file')}"
                          "), where a lock file belongs: remove it and run again")
    os.set_blocking(fd, True)
    return fd


_KINDS = {stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device",
          stat.S_IFBLK: "block device", stat.S_IFDIR: "directory"}


@contextmanager
def exclusive(path: Path, *, wait: bool = True, holder: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing; LockRefused when the name
    is a symbolic link, a directory or another non-regular file) for the context.

    `wait=False`: raise LockHeld at once when another process holds it. `holder`: a line
    written into the file while the lock is held, which LockHeld gives those refused.

    The file is deleted on the way out, still locked; a process that then gets the lock of the
    deleted file sees that the name now points elsewhere (or nowhere) and locks again."""
    while True:
        lock = os.fdopen(_open_lock(path), "r+")
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                lock.seek(0)
                raise LockHeld(path, lock.read().strip()) from None
            if _same_file(path, lock.fileno()):
                break
        except BaseException:
            lock.close()
            raise
        lock.close()
    try:
        if holder is not None:
            lock.truncate(0)
            lock.write(holder + "\n")
            lock.flush()
        yield
    finally:
        path.unlink(missing_ok=True)
        lock.close()  # releases the lock


def _same_file(path: Path, fd: int) -> bool:
    """Whether `path` still names the open file `fd`."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
