"""The policy learner's checkpoints: when they are due, what it writes and reads, in which order.

Checkpoints are written every `checkpoint_every` steps or `checkpoint_every_s` seconds, between two
steps: the batches not yet trained are taken from the learner's mailbox first, then the other parts
(the prompt source's cursor and ledger, the value learner) are written, then the learner's own
state, and the directory is committed atomically. Taking the batches before the ledger is what
keeps resume exact: a sample is either in a saved batch, or open in the ledger and regenerated, or
already ended. The run directory's node begins and commits every checkpoint
(`asyncrl.storage.checkpoint_transfer`): a learner on a node without that disk ships its part there.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

from ray.exceptions import RayTaskError

from asyncrl.messages.structs import TrainBatch
from asyncrl.storage import checkpoint, checkpoint_parts
from asyncrl.storage.checkpoint_transfer import WriterClient, local_copy, write_part


@dataclass(frozen=True)
class CheckpointPolicy:
    run_dir: str = ""  # empty: no checkpoints
    every_steps: int = 0  # 0: not by steps
    every_s: float = 0.0  # 0: not by time
    keep: int = 1
    writer: WriterClient | None = None  # the run directory's checkpoint writer (default: in this process)

    def due(self, step: int, since_last_s: float) -> bool:
        if not self.run_dir:
            return False
        return (self.every_steps > 0 and step % self.every_steps == 0) or (0 < self.every_s <= since_last_s)


class LearnerCheckpoints:
    """Checkpoint coordination of `actors.policy_learner.PolicyLearner` (a part of that class: it
    reads the learner's step, version, counters, locks, mailbox and ranks)."""

    async def save_checkpoint(self) -> str:
        """Write a checkpoint of the current step (between two steps) and return its path (on the
        run directory's node). A disk that refuses raises `checkpoint.CheckpointWriteError`."""
        if self.writer is None:
            raise RuntimeError("checkpoints need a run directory")
        async with self._step_lock:  # also waits for a checkpoint in progress
            if self.last_checkpoint.get("step") == self.step:  # this step is saved already
                return self.last_checkpoint["path"]
            start = time.perf_counter()
            tmp = await asyncio.to_thread(self.writer.call, "begin", self.step)
            try:
                pending = await self.batches.drain_unacked()  # before the ledger: see the module doc
                await asyncio.gather(*(part(tmp, self.writer) for part in self.edges.checkpoint_parts))
                async with self._weights_lock:
                    state = await self._on_every_rank("state")
                await asyncio.to_thread(write_part, self.writer, tmp,
                                        lambda directory: self._write_state(directory, pending, *state))
                path = await asyncio.to_thread(self.writer.call, "commit", tmp, self.step, self.checkpoints.keep)
            except BaseException as exc:
                await asyncio.to_thread(self.writer.call, "discard", tmp)  # what it took, back
                if isinstance(exc, checkpoint.CheckpointWriteError):
                    # Its own message (a part's arrives wrapped by Ray): the run stops on this error.
                    raise checkpoint.CheckpointWriteError(str(exc.cause if isinstance(exc, RayTaskError) else exc)) \
                        from None
                raise
            elapsed = time.perf_counter() - start
            self.timing["checkpoint_s"] += elapsed
            self.counters["checkpoints"] += 1
            self._last_checkpoint_at = time.monotonic()
            self.last_checkpoint = {"path": path, "step": self.step, "seconds": elapsed,
                                    "saved_batches": len(pending)}
            return path

    def _write_state(self, directory: str, pending_batches: list[TrainBatch], weights: dict, optimizer: dict,
                     scheduler: dict) -> None:
        self.policy.save_policy(os.path.join(directory, "policy"), weights, self.tokenizer)  # LoRA: the adapter
        # The optimizer's state by parameter name, whole: the same file for any number of ranks.
        checkpoint_parts.save_tensors({"optimizer": optimizer, "scheduler": scheduler}, os.path.join(directory, "learner.pt"))
        checkpoint_parts.save_json({"step": self.step, "weight_version": self.weight_version, "incarnation": self.incarnation,
                              "counters": self.counters}, os.path.join(directory, "learner.json"))
        checkpoint_parts.save_batches(pending_batches, os.path.join(directory, "batches.msgpack"))

    async def load_checkpoint(self, directory: str) -> None:
        """Continue from a checkpoint (its path on the run directory's node): weights, optimizer,
        scheduler, step, version, counters."""
        copy = local_copy(self.writer, directory, ["policy", "learner.pt", "learner.json"])
        local = await asyncio.to_thread(copy.__enter__)
        try:
            await self._load_checkpoint(local)
        finally:
            await asyncio.to_thread(copy.__exit__, None, None, None)

    async def _load_checkpoint(self, directory: str) -> None:
        weights = self.policy.read_policy(os.path.join(directory, "policy"))
        state = checkpoint_parts.load_tensors(os.path.join(directory, "learner.pt"))
        async with self._weights_lock:
            await self._on_every_rank("load", {}, {}, state["scheduler"],
                                      rank0_args=(weights, state["optimizer"], state["scheduler"]))
        meta = checkpoint_parts.load_json(os.path.join(directory, "learner.json"))
        self.step, self.weight_version = int(meta["step"]), int(meta["weight_version"])
        self.incarnation = int(meta.get("incarnation", 0)) + 1
        self.counters.update({k: v for k, v in meta["counters"].items() if k in self.counters})
        self._adam_steps = self.policy.optimizer_steps()
