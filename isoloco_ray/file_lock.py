"""Exclusive locks on a file name, held through an open file (`flock`): the kernel releases a
lock when its holder exits, however it exits, so no lock outlives the process that took it (on
NFS, once the server's lease on a lost client runs out). They do not work on object storage."""

from __future__ import annotations

import fcntl
import os
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


@contextmanager
def exclusive(path: Path, *, wait: bool = True, holder: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing) for the context.

    `wait=False`: raise LockHeld at once when another process holds it. `holder`: a line
    written into the file while the lock is held, which LockHeld gives those refused.

    The file is deleted on the way out, still locked; a process that then gets the lock of the
    deleted file sees that the name now points elsewhere (or nowhere) and locks again."""
    while True:
        lock = open(path, "a+")
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
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
