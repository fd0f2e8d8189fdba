"""Tearing down a rank's own process group from another thread, when a peer can neither die nor
answer.

A peer on a hung or cut-off host holds its connections open: a gloo collective waiting on it blocks
until the group timeout, and nothing in torch 2.13 unblocks it from another thread (`abort()`,
`shutdown()` and `destroy_process_group()` return at once and change nothing). The coordinator
cannot kill such a peer (its node does not answer), so the survivors cut their side: each rank
records the sockets its group opened (those that appeared while `init_process_group` ran) and, told
to abort, shuts its connections down (never its listener: gloo aborts the process when its accept
fails). The blocked collective then fails at once, as if the peer had died, and the rank freezes as
after any failure. Groups the script makes later (`dist.new_group`, a device mesh's sub-groups made
once the job's group formed) are recorded as they are made (`watch_new_groups`): a collective of
theirs blocked on a peer fails at a freeze too.

Shutting a socket down does not close its descriptor (gloo still owns and closes it), and a socket
is matched by its inode, never a descriptor number that may have been reused. Linux only (`/proc`);
elsewhere nothing is recorded and an abort cuts nothing: the collective fails at its timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_FDS = Path("/proc/self/fd")


def socket_inodes() -> dict[int, int]:
    """This process's sockets: descriptor -> socket inode."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in _FDS.iterdir():
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(entry)
                if target.startswith("socket:["):
                    out[int(entry.name)] = int(target[8:-1])
    return out


class GroupSockets:
    """The sockets one process group opened, to cut when the group must be abandoned."""

    def __init__(self) -> None:
        self._before: set[int] = set()
        self.inodes: frozenset[int] = frozenset()

    def forming(self) -> None:
        """Call just before the group is made."""
        self._before = set(socket_inodes().values())
        self.inodes = frozenset()

    def formed(self) -> None:
        """Call once it is made: the sockets that appeared meanwhile are its own."""
        self.inodes = frozenset(set(socket_inodes().values()) - self._before)

    def watch_new_groups(self) -> None:
        """From now on, the sockets of every group made in this process (torch makes every group,
        a device mesh's included, through `_new_group_with_tag`) are this group's too."""
        make = c10d._new_group_with_tag
        if getattr(make, "_torchpass_watched", False):
            return

        def watched(*args: Any, **kwargs: Any) -> Any:
            before = set(socket_inodes().values())
            try:
                return make(*args, **kwargs)
            finally:
                self.inodes = self.inodes | (set(socket_inodes().values()) - before)

        watched._torchpass_watched = True  # type: ignore[attr-defined]
        c10d._new_group_with_tag = watched

    def abort(self, nccl: bool) -> None:
        """From the control thread: make a collective blocked on a peer that will never answer fail
        now. Gloo's connections are cut; NCCL's communicators are aborted, which NCCL supports from
        another thread (an already broken group may refuse: the cut stands)."""
        self.cut()
        if nccl and dist.is_initialized():
            with contextlib.suppress(Exception):
                c10d._abort_process_group()

    def cut(self) -> int:
        """Shut down every socket of the group still open (a blocked collective on it fails at
        once); how many were cut."""
        n = 0
        for fd, inode in socket_inodes().items():
            if inode not in self.inodes:
                continue
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=os.dup(fd))
                try:
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue  # gloo's listener: shut down, its accept loop aborts the process
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
                finally:
                    s.close()  # the duplicate only: the group's own descriptor stays gloo's
        return n
