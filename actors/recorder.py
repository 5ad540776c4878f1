"""Trajectory recorder: writes the run's trajectory store (`asyncrl.storage.trajectory_store`) in its own process (the
role and its Ray shell).

The assembler sends the records of finished samples (kept or dropped) and the learner the batches
it trained, both as msgspec bytes in calls nobody waits for, so recording never holds up
generation or training. Rows are written every `flush_s` in a thread; files roll by size and age,
and `close()` (at stop) closes the file in progress, so every sample that reached the recorder is
in a closed file.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from actors.base import RoleShell
from asyncrl.storage.checkpoint import disk_refusal
from asyncrl.storage.trajectory_store import (BATCH_RECORD_DECODER, BATCH_SCHEMA, RECORDS_DECODER, TRAJECTORY_SCHEMA,
                                             StoreWriter, keep_images)


class TrajectoryRecorder:
    def __init__(self, directory: str, max_file_bytes: int = 64 << 20, max_file_age_s: float = 600.0,
                 flush_s: float = 5.0, keep_bytes: int = 0):
        """`keep_bytes` > 0: the store's oldest closed files go past this total (`asyncrl.storage.trajectory_store`)."""
        self.directory = directory
        self.trajectories = StoreWriter(directory, "trajectories", TRAJECTORY_SCHEMA, max_file_bytes, max_file_age_s,
                                        keep_bytes, prepare=keep_images)
        self.batches = StoreWriter(directory, "batches", BATCH_SCHEMA, max_file_bytes, max_file_age_s, keep_bytes)
        self.flush_s = flush_s
        self._lock = asyncio.Lock()  # one writer thread at a time
        self._running = False
        self.counters = {"trajectories_received": 0, "batches_received": 0, "flushes": 0, "write_s": 0.0}

    def add_trajectories(self, encoded: bytes) -> int:
        records = RECORDS_DECODER.decode(encoded)
        self.trajectories.append([msgspec.structs.asdict(r) for r in records])
        self.counters["trajectories_received"] += len(records)
        return len(records)

    def add_batch(self, encoded: bytes) -> None:
        record = BATCH_RECORD_DECODER.decode(encoded)
        self.batches.append([msgspec.structs.asdict(record)])
        self.counters["batches_received"] += 1

    async def flush(self, close: bool = False) -> None:
        async with self._lock:
            start = time.perf_counter()
            for writer in (self.trajectories, self.batches):
                try:
                    await asyncio.to_thread(writer.close if close else writer.flush)
                except OSError as exc:  # a full disk: one error that stops the run, not a restart loop
                    refused = disk_refusal(exc, self.directory, "the trajectory store's rows")
                    if refused is None:
                        raise
                    raise refused from None
            self.counters["write_s"] += time.perf_counter() - start
            self.counters["flushes"] += 1

    async def run(self) -> None:
        self._running = True
        while self._running:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    def stop(self) -> None:
        self._running = False

    async def close(self) -> None:
        """Write everything received and close the files in progress (the run is stopping)."""
        self._running = False
        await self.flush(close=True)

    def stats(self) -> dict:
        return {**self.counters, "trajectory_rows_written": self.trajectories.rows_written,
                "batch_rows_written": self.batches.rows_written,
                "files_closed": self.trajectories.files_closed + self.batches.files_closed,
                "files_deleted": self.trajectories.files_deleted + self.batches.files_deleted}


class RecorderActor(RoleShell):
    def __init__(self, directory: str, max_file_mb: int, max_file_age_s: float, keep_mb: int = 0):
        self.inner = TrajectoryRecorder(directory, max_file_mb << 20, max_file_age_s, keep_bytes=keep_mb << 20)

    def add_trajectories(self, encoded: bytes) -> int:
        return self.inner.add_trajectories(encoded)

    def add_batch(self, encoded: bytes) -> None:
        self.inner.add_batch(encoded)

    async def close(self) -> None:
        await self.inner.close()
