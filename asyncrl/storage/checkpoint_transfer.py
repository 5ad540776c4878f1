"""Checkpoints that reach the run directory from any node.

The run directory belongs to the node of the process that runs the run (the driver of `asyncrl
train`, or the Serve controller): its records and its checkpoints are there, and a restart,
`resume=true`, evaluation and export read them there. A role on another node (a GPU learner, a
value learner) may not see that directory (no shared filesystem). So the one writer of the
checkpoints directory is `CheckpointWriter`, on the run directory's node (a Ray actor of its own:
`WriterClient.spawn`): it begins and commits every checkpoint. A role that sees the
directory (it finds the writer's marker file with the writer's token: one node, or a shared
filesystem) writes its part straight into the checkpoint being written; one that does not writes
its part into a staging directory of its own node and ships the files in chunks to the writer; on
resume it fetches the files it needs the same way (`local_copy`).

A checkpoint on the run's node also outlives the learner's node: a restart places the learner
wherever there is room and gives it the checkpoint. The cost, where nothing is shared, is the
learner's state crossing the network at each checkpoint and each restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from asyncrl.storage import checkpoint

CHUNK_BYTES = 8 << 20  # one call carries this much of a file
IN_FLIGHT = 4  # chunks on their way at once (memory: IN_FLIGHT x CHUNK_BYTES)
CALL_TIMEOUT_S = 600.0  # a writer that does not answer a chunk in this long is hung, not slow
MARKER = ".checkpoint_writer"  # in the run directory (the checkpoints directory holds checkpoints only)


class CheckpointWriter:
    """Every write to one run's checkpoints directory, on the run directory's node. Paths given by
    callers are checked to stay inside it."""

    def __init__(self, run_dir: str, token: str = ""):
        """`token`: the one its marker holds (`publish_marker` wrote it); empty: write a new one."""
        self.run_dir = os.path.abspath(run_dir)
        self.root = checkpoint.checkpoints_dir(self.run_dir)
        os.makedirs(self.root, exist_ok=True)
        self.marker, self.token = (os.path.join(self.run_dir, MARKER), token) if token else publish_marker(run_dir)
        self.counters = {"chunks_received": 0, "bytes_received": 0, "chunks_sent": 0, "bytes_sent": 0}

    def where(self) -> tuple[str, str]:
        """(the marker file's path, its token): a process that reads the token there sees this directory."""
        return self.marker, self.token

    def begin(self, step: int) -> str:
        return checkpoint.begin(self.run_dir, step)

    def commit(self, tmp: str, step: int, keep_last: int) -> str:
        return checkpoint.commit(self._inside(tmp), step, keep_last)

    def discard(self, tmp: str) -> None:
        """Remove a checkpoint that will not be committed (a part failed)."""
        shutil.rmtree(self._inside(tmp), ignore_errors=True)

    def write(self, tmp: str, rel: str, offset: int, data: bytes) -> None:
        """Bytes of a part's file, at `offset` (chunks of one file may arrive in any order)."""
        path = self._inside(os.path.join(tmp, rel))
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            refused = checkpoint.disk_error(exc, self.root, checkpoint.step_of(tmp), self.root)
            if refused is None:
                raise
            raise refused from None
        self.counters["chunks_received"] += 1
        self.counters["bytes_received"] += len(data)

    def files(self, path: str, names: list[str]) -> list[tuple[str, int]]:
        """(path relative to the checkpoint, size) of the files `names` (files or directories) of a
        checkpoint."""
        base = self._inside(path)
        out = []
        for name in names:
            top = self._inside(os.path.join(base, name))
            if os.path.isfile(top):
                out.append((name, os.path.getsize(top)))
            for directory, _, files in os.walk(top):
                for file in files:
                    full = os.path.join(directory, file)
                    out.append((os.path.relpath(full, base), os.path.getsize(full)))
        return sorted(out)

    def read(self, path: str, rel: str, offset: int, size: int) -> bytes:
        with open(self._inside(os.path.join(path, rel)), "rb") as f:
            f.seek(offset)
            data = f.read(size)
        self.counters["chunks_sent"] += 1
        self.counters["bytes_sent"] += len(data)
        return data

    def stats(self) -> dict:
        return dict(self.counters)

    def _inside(self, path: str) -> str:
        full = os.path.realpath(path)
        if os.path.commonpath([full, os.path.realpath(self.root)]) != os.path.realpath(self.root):
            raise ValueError(f"{path} is outside the checkpoints directory {self.root}")
        return full


def publish_marker(run_dir: str) -> tuple[str, str]:
    """A fresh token in the run directory's marker file: (its path, the token). A process that
    reads that token there sees the run directory itself."""
    os.makedirs(run_dir, exist_ok=True)
    marker, token = os.path.join(os.path.abspath(run_dir), MARKER), uuid.uuid4().hex
    with open(marker + ".tmp", "w") as f:
        f.write(token)
    os.replace(marker + ".tmp", marker)
    return marker, token


def wait_from_thread(refs: list, timeout_s: float = CALL_TIMEOUT_S) -> list:
    """The results of Ray calls, waited for in a worker thread of an actor: never on an event loop,
    which it would stop (refused, naming the mistake), and not through `ray.get`, which warns of a
    blocking get in any asyncio actor, whichever thread calls it. A writer past `timeout_s` raises
    TimeoutError."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no loop runs in this thread: waiting here stops nothing else
    else:
        raise RuntimeError("a checkpoint transfer was called on an event loop: run it in a thread "
                           "(asyncio.to_thread), or the actor stops answering while it waits")
    futures = [ref.future() for ref in refs]
    deadline = time.monotonic() + timeout_s
    return [future.result(timeout=max(0.0, deadline - time.monotonic())) for future in futures]


@dataclass(frozen=True)
class WriterClient:
    """A role's way to its run's `CheckpointWriter`: the writer itself (in this process) or its Ray
    actor, with where its marker is (read once, when the run wires its roles)."""

    target: Any  # a CheckpointWriter, or its actor's handle
    marker: str
    token: str

    @classmethod
    def local(cls, run_dir: str) -> "WriterClient":
        writer = CheckpointWriter(run_dir)
        return cls(writer, *writer.where())

    @classmethod
    def spawn(cls, run_dir: str, spawn: Callable[..., Any]) -> "WriterClient":
        """The writer as an actor that `spawn(CheckpointWriter, **kwargs)` makes on this node, the run
        directory's; its marker is written from here, so nothing waits for the actor to start."""
        marker, token = publish_marker(run_dir)
        return cls(spawn(CheckpointWriter, run_dir=os.path.abspath(run_dir), token=token), marker, token)

    def call(self, method: str, *args):
        """A writer method, in this process or on the writer's node (blocking: call from a thread)."""
        if isinstance(self.target, CheckpointWriter):
            return getattr(self.target, method)(*args)
        return wait_from_thread([getattr(self.target, method).remote(*args)])[0]

    def submit(self, method: str, *args):
        """Start a writer method: its Ray reference (None in this process, where it ran already)."""
        if isinstance(self.target, CheckpointWriter):
            getattr(self.target, method)(*args)
            return None
        return getattr(self.target, method).remote(*args)

    def settle(self, submitted: list) -> None:
        """Wait for methods `submit` started (raising the first one's error)."""
        refs = [ref for ref in submitted if ref is not None]
        if refs:
            wait_from_thread(refs)

    def sees_directory(self) -> bool:
        """Does this process see the run's checkpoints directory itself (same node, or shared)?"""
        try:
            with open(self.marker) as f:
                return f.read() == self.token
        except OSError:
            return False


def write_part(writer: WriterClient, tmp: str, write: Callable[[str], None]) -> None:
    """Have `write(directory)` write a part of the checkpoint being written at `tmp`: straight into
    it where this process sees it, else into a staging directory here whose files are shipped to
    the writer. A disk that refuses raises `checkpoint.CheckpointWriteError`."""
    step = checkpoint.step_of(tmp)
    if writer.sees_directory():
        _refusals(write, tmp, step, os.path.dirname(tmp))
        return
    stage = tempfile.mkdtemp(prefix="asyncrl-checkpoint-part-")
    try:
        _refusals(write, stage, step, None)  # this node's staging disk
        _upload(writer, stage, tmp)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _refusals(write: Callable[[str], None], directory: str, step: int, root: str | None) -> None:
    try:
        write(directory)
    except OSError as exc:
        refused = checkpoint.disk_error(exc, root or directory, step, root)
        if refused is None:
            raise
        raise refused from None


def _upload(writer: WriterClient, stage: str, tmp: str) -> None:
    """Every file under `stage` into the checkpoint `tmp`, in chunks, a few on their way at once."""
    pending: list = []
    for directory, _, files in os.walk(stage):
        for name in sorted(files):
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, stage)
            with open(full, "rb") as f:
                offset = 0
                while True:
                    data = f.read(CHUNK_BYTES)
                    if data or offset == 0:  # an empty file is written too
                        pending.append(writer.submit("write", tmp, rel, offset, data))
                    if len(pending) >= IN_FLIGHT:
                        writer.settle(pending[:1])
                        pending = pending[1:]
                    if len(data) < CHUNK_BYTES:
                        break
                    offset += len(data)
    writer.settle(pending)


@contextlib.contextmanager
def local_copy(writer: WriterClient | None, path: str, names: list[str]) -> Iterator[str]:
    """A directory holding the files `names` of the checkpoint at `path` (a path on the run's node):
    `path` itself where this process sees it, else a copy fetched from the writer (removed after)."""
    if writer is None or writer.sees_directory():
        yield path
        return
    stage = tempfile.mkdtemp(prefix="asyncrl-checkpoint-")
    try:
        for rel, size in writer.call("files", path, names):
            target = os.path.join(stage, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                for offset in range(0, size, CHUNK_BYTES):
                    f.write(writer.call("read", path, rel, offset, CHUNK_BYTES))
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)
