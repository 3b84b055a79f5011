"""A finish-time board: the members of one group agree on a collective's emulated finish through shared memory.

With link emulation every member of a collective ends at its slowest member's emulated finish
(:meth:`moelab.comm.door.Communicator._emulate`). Agreeing on that maximum with a gloo all-reduce costs
a full collective per call (~1-2 ms on ranks that share a few cores), about as much as the call's own
software; Lina's partitioned all-reduce makes hundreds of calls a step. When every member runs on one
host the maximum can be agreed through a small shared file instead:

- the board of a group is an ``int64`` array ``[SLOTS, members]`` in a memory-mapped file;
- a member's ``k``-th agreement writes ``stamp(k) << 40 | microseconds since the board's origin``
  into slot ``k mod SLOTS`` (``stamp(k) = k mod (2^23 - 1) + 1``, never the zero of a fresh file; one
  aligned 8-byte store: a reader sees the old or the new word, never a mix), then polls the slot's row
  until every member's word carries ``stamp(k)`` and returns their maximum (the first polls only yield
  the core: the last member is often just due);
- a member reaches agreement ``k + 1`` only after every member has written ``k``, so no member can
  overwrite slot ``k mod SLOTS`` before all have read it (two slots would do; :data:`SLOTS` is 8).

Members must agree in the same order (the k-th wait on the group pairs with every member's k-th), as the
all-reduce required. The file is unlinked once every member has mapped it (the caller's barrier), so
nothing stays behind if a rank dies. Groups spanning hosts keep the all-reduce (:func:`same_host`, :func:`host_key`).
"""
from __future__ import annotations

import mmap
import os
import socket
import tempfile
import threading
import time
import uuid

import numpy as np

SLOTS = 8
_TIME_BITS = 40  # microseconds: 12.7 days after the origin
_TIME_MASK = (1 << _TIME_BITS) - 1
_STAMP_MOD = 1 << 23  # 23 + 40 bits: a positive int64
POLL_S = 50e-6
YIELDS = 3  # polls that only yield the core before sleeping POLL_S between polls


def board_dir() -> str:
    """``/dev/shm`` where it exists (memory, not disk), else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def host_key() -> str:
    """Who can share a board file with whom: the kernel's boot id (the hostname where there is none) and the
    board directory's device and inode, so two containers with their own ``/dev/shm`` never count as one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    st = os.stat(board_dir())
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def same_host(hosts, ranks) -> bool:
    """Whether every rank of ``ranks`` can share a board (``hosts[r]``: rank r's :func:`host_key`)."""
    return len({hosts[r] for r in ranks}) == 1


class Board:
    """One member's view of a group's board (``members`` ranks, this one at ``index``)."""

    def __init__(self, path: str, members: int, index: int, origin: float):
        if not 0 <= index < members:
            raise ValueError(f"member index {index} outside 0..{members - 1}")
        self.path, self.members, self.index, self.origin = path, members, index, float(origin)
        size = SLOTS * members * 8
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zero-filled; every member asks for the same size
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._words = np.frombuffer(self._mm, dtype=np.int64).reshape(SLOTS, members)
        self._k = 0
        self._lock = threading.Lock()

    def unlink(self) -> None:
        """Remove the file (the mapping stays): call once every member has mapped it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def agree(self, finish: float, timeout: float = 600.0) -> float:
        """The maximum of every member's ``finish`` (absolute seconds) in this, the k-th, agreement."""
        with self._lock:
            k = self._k
            self._k += 1
        stamp = k % (_STAMP_MOD - 1) + 1  # never 0: a fresh (zero-filled) word carries no stamp
        us = min(max(int(round((finish - self.origin) * 1e6)), 0), _TIME_MASK)
        row = self._words[k % SLOTS]
        row[self.index] = (stamp << _TIME_BITS) | us
        deadline = time.monotonic() + timeout
        polls = 0
        while True:
            words = row.copy()
            if np.all((words >> _TIME_BITS) == stamp):
                return self.origin + float((words & _TIME_MASK).max()) * 1e-6
            if time.monotonic() > deadline:
                missing = [i for i, w in enumerate(words) if (int(w) >> _TIME_BITS) != stamp]
                raise TimeoutError(f"finish-time board {os.path.basename(self.path)}: members {missing} did not "
                                   f"reach agreement {k} within {timeout:.0f} s")
            polls += 1
            time.sleep(0 if polls <= YIELDS else POLL_S)  # yield first: the last member is often just due


class Boards:
    """The boards of one rank's communicator: every rank's :func:`host_key`, the run's token (file names)
    and origin (times), gathered once at build (:meth:`setup`, collective); :meth:`open` maps a group's
    board, :meth:`mapped` removes the files once every rank has mapped its own."""

    def __init__(self, hosts, token: str, origin: float):
        self.hosts, self.token, self.origin = list(hosts), str(token), float(origin)
        self._new: list = []

    @classmethod
    def setup(cls, dist, world_size: int) -> "Boards":
        hosts = [None] * world_size
        dist.all_gather_object(hosts, host_key())
        head = [uuid.uuid4().hex[:12], time.time() - 1.0]
        dist.broadcast_object_list(head, src=0)
        return cls(hosts, head[0], head[1])

    def shared(self, ranks) -> bool:
        return same_host(self.hosts, ranks)

    def open(self, name: str, ranks, rank: int) -> Board:
        """This member's view of the board of group ``name`` over ``ranks``."""
        tag = "".join(c if c.isalnum() else "_" for c in f"{name}-{'-'.join(map(str, ranks))}")
        board = Board(os.path.join(board_dir(), f"moelab-{self.token}-{tag}"), len(ranks), list(ranks).index(rank),
                      self.origin)
        self._new.append(board)
        return board

    def mapped(self, dist) -> None:
        """Every rank has mapped its new boards (a barrier): remove their files."""
        dist.barrier()
        for board in self._new:
            board.unlink()
        self._new.clear()
