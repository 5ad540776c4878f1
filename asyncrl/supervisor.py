"""Keeping a run alive: when any actor of the system dies, bring the whole system back from the
newest valid checkpoint (`trainer.max_restarts` times at most).

Why the whole system, not the one actor: the weight group is a fixed-size `torch.distributed`
collective, so a dead generator leaves every later broadcast waiting for it, and the assembler's
open groups and the generators' sequences are not persisted. Resuming from the checkpoint is the
one recovery that is exact (see `docs/architecture.md`, checkpoints and resume): in-flight work is
regenerated from the ledger, nothing is trained twice, and the new generators hold the
checkpoint's weights before their first prompt. The cost is the steps since that checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ray.exceptions import RayError

from asyncrl import checkpoint
from asyncrl.config import Config
from asyncrl.system import TrainingSystem


RESTART_ATTEMPTS = 4
RESTART_WAIT_S = 10.0


class Supervisor:
    def __init__(self, config: Config, run_dir: str, max_steps: int = 0):
        self.config = config
        self.run_dir = run_dir
        self.max_steps = max_steps
        self.restarts: list[dict[str, Any]] = []
        self.system = TrainingSystem(config, run_dir=run_dir, max_steps=max_steps).start()

    def check(self) -> dict | None:
        """Raise nothing while the system is alive; after a death, restart it from the newest
        checkpoint and return what happened (or re-raise when it cannot)."""
        try:
            self.system.check_alive()
            return None
        except Exception as exc:  # an actor loop ended: its error, or ActorDiedError
            return self.restart(f"{type(exc).__name__}: {exc}".splitlines()[0][:300], exc)

    def restart(self, reason: str, cause: BaseException | None = None) -> dict:
        start = time.perf_counter()
        # Stop first: a learner still alive could otherwise commit newer checkpoints and prune the
        # one chosen below.
        self.system.stop()
        latest, _ = checkpoint.latest_valid(self.run_dir) if self.run_dir else (None, [])
        if len(self.restarts) >= self.config.trainer.max_restarts or latest is None:
            why = "no checkpoint to restart from" if latest is None else \
                f"trainer.max_restarts={self.config.trainer.max_restarts} used up"
            raise RuntimeError(f"the run cannot recover ({why}) from: {reason}") from cause
        resumed = dataclasses.replace(self.config, resume=True)
        for attempt in range(RESTART_ATTEMPTS):
            try:
                self.system = TrainingSystem(resumed, run_dir=self.run_dir, max_steps=self.max_steps).start()
                break
            except RayError as exc:
                # A node that is dying may still take actors until Ray has marked it dead (its
                # heartbeats time out): they die with it. Try again once that has happened.
                if attempt == RESTART_ATTEMPTS - 1:
                    raise RuntimeError(f"the run could not restart after {reason}: {exc}") from exc
                time.sleep(RESTART_WAIT_S)
        event = {"reason": reason, "restart_s": time.perf_counter() - start, "at": time.time(),
                 **{k: self.system.resumed[k] for k in ("checkpoint", "step", "reissued_prompts", "saved_batches")}}
        self.restarts.append(event)
        return event

    def stop(self) -> None:
        self.system.stop()
