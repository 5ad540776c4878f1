"""Versions of the policy's weights in the node's shared memory: the `shm` path of
`asyncrl.weights.transport`. The learner copies each version's tensors into one of two files of the
node's shared memory, written in turn (`SharedSlots`; a reader never sees a file being written);
a generator on that node maps the file once and its engine adopts views of it as its parameters
(`shared_views`). Files of a learner that died are removed at the next start (`remove_orphaned_slots`).
"""

from __future__ import annotations

import glob
import mmap
import os
import tempfile
import uuid
import warnings
from typing import Iterable

import msgspec
import torch

from asyncrl.weights.sync import TensorSlot, WeightTransferError, tensor_slot


class SharedVersion(msgspec.Struct, frozen=True):
    """Where one version lies in the node's shared memory: a file every process on the node maps,
    and each tensor's place in it (offsets aligned for any dtype)."""

    path: str
    nbytes: int
    tensors: list[TensorSlot]


SHARED_PREFIX = "asyncrl-weights"
_ALIGN = 64


def shared_layout(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorSlot], int]:
    """Each tensor's place in a slot file, in order, every offset a multiple of 64 bytes."""
    slots, used = [], 0
    for name, tensor in named_tensors:
        slots.append(tensor_slot(name, tensor, used))
        used += -(-slots[-1].nbytes // _ALIGN) * _ALIGN
    return slots, used


def _map_file(path: str, nbytes: int, writable: bool) -> torch.Tensor:
    """The whole file as one uint8 tensor over a shared mapping (its pages populated up front)."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable" (readers)
        return torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping alive


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedSlots:
    """The learner's side of `shm`: two files in the node's shared memory (`/dev/shm`), written in
    turn, one version each. A copy into pages written before runs at memory bandwidth; a fresh
    allocation per version (Ray's object store, the first implementation) paid a page fault per
    4 KB and reached 9% of it. A slot is rewritten only when no generator views it: the learner
    sends version v+1 only once every generator holds v, so the slot of v-1 is free. A failed
    delivery leaves that unknown: `invalidate` moves on to fresh files. `close` (and a later
    learner on the node, for files whose process is gone) removes them."""

    def __init__(self, directory: str | None = None, count: int = 2):
        self.directory = directory
        self.count = count
        self._files: list[str] = []
        self._maps: list[torch.Tensor] = []
        self._capacity = 0  # bytes of each file: a smaller version (a delta) reuses them
        self._fresh = True  # the next write goes to new files
        self._next = 0
        self._generation = 0
        self.closed = False  # after `close`, until `open`: a late write would leave files behind
        # In every file name: a generator caches its mappings by path, and a reused pid must not
        # name a new file like one it still maps.
        self._token = uuid.uuid4().hex[:8]

    def _allocate(self, nbytes: int) -> None:
        self._release()
        directory = self.directory or shared_directory(nbytes * self.count)
        remove_orphaned_slots(directory)
        self._files, self._maps = [], []
        for i in range(self.count):
            path = os.path.join(directory, f"{SHARED_PREFIX}-{os.getpid()}-{self._token}-{self._generation}-{i}")
            with open(path, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, nbytes)  # reserve the pages now: a full /dev/shm fails here
            self._files.append(path)
            self._maps.append(_map_file(path, nbytes, writable=True))
        self._generation += 1
        self._capacity, self._fresh = nbytes, False

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SharedVersion:
        """Copy a version's tensors into the next slot; what a generator on this node maps."""
        if self.closed:
            raise WeightTransferError("shared weight slots are closed (the learner stopped)")
        named = [(name, t.detach()) for name, t in named_tensors]
        tensors, nbytes = shared_layout(named)
        if self._fresh or not self._maps or nbytes > self._capacity:
            self._allocate(nbytes)
        index = self._next
        self._next = (self._next + 1) % self.count
        buffer = self._maps[index]
        with torch.no_grad():
            for (_, tensor), slot in zip(named, tensors):
                target = buffer[slot.offset:slot.offset + slot.nbytes].view(tensor.dtype).view(tensor.shape)
                target.copy_(tensor)
        return SharedVersion(self._files[index], buffer.numel(), tensors)

    def invalidate(self) -> None:
        """A generator may still view either slot (a delivery failed): the next version goes to new files."""
        self._fresh = True

    def open(self) -> None:
        self.closed = False

    def close(self) -> None:
        """Remove the files (a generator that mapped one keeps its pages until it lets go); no
        more writes until `open`."""
        self.closed = True
        self._release()

    def _release(self) -> None:
        for path in self._files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._files, self._maps = [], []


def shared_directory(nbytes: int) -> str:
    """`/dev/shm` when it has room for `nbytes` (a container's default is 64 MB: give it
    `--shm-size`), else the temporary directory (a shared mapping of a file there still works,
    through the page cache)."""
    if os.path.isdir("/dev/shm"):
        stat = os.statvfs("/dev/shm")
        if stat.f_bavail * stat.f_frsize > nbytes * 1.1:
            return "/dev/shm"
    return tempfile.gettempdir()


def remove_orphaned_slots(directory: str) -> int:
    """Remove slot files left by learners that are gone (a killed actor cannot clean up)."""
    removed = 0
    for path in glob.glob(os.path.join(directory, f"{SHARED_PREFIX}-*")):
        try:
            pid = int(os.path.basename(path)[len(SHARED_PREFIX) + 1:].split("-")[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


# A generator maps each slot file once and keeps the mapping (the learner rewrites the same files):
# adopting a version is then a pointer swap, no page fault. Only the newest files are kept.
_READER_MAPS: dict[str, torch.Tensor] = {}


def shared_views(version: SharedVersion) -> list[tuple[str, torch.Tensor]]:
    """Read-only tensors viewing a version in shared memory (no copy). An engine adopts them as its
    parameters (it never writes its weights); each view holds its mapping alive."""
    buffer = _READER_MAPS.get(version.path)  # a path names one file for good (pid and a random token)
    if buffer is None:
        buffer = _map_file(version.path, version.nbytes, writable=False)
        _READER_MAPS[version.path] = buffer
        while len(_READER_MAPS) > 4:  # two learners' slots at most (a restart): drop the oldest
            del _READER_MAPS[next(iter(_READER_MAPS))]
    return [(slot.name, buffer[slot.offset:slot.offset + slot.nbytes].view(getattr(torch, slot.dtype)).view(slot.shape))
            for slot in version.tensors]


# --- CUDA IPC (same host, CUDA) --------------------------------------------------------------------
