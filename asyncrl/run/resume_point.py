"""Where a resumed run continues from: the newest valid checkpoint of its run directory, and what
it holds (the weight version, the batches assembled and not yet trained, the samples inside them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import Config
from asyncrl.storage import checkpoint, checkpoint_parts


@dataclass
class ResumePoint:
    checkpoint: str
    weight_version: int
    incarnation: int  # how many times the run was resumed (batch ids stay unique across them)
    saved_batches: list = field(default_factory=list)  # assembled, not yet trained
    held_sample_ids: set = field(default_factory=set)  # samples inside those batches


def resume_point(config: Config, run_dir: str) -> tuple[ResumePoint | None, dict[str, Any]]:
    """With `resume=true`: the newest valid checkpoint of `run_dir` and what it holds, with the
    summary a status reports (`resumed`); None and {} for a fresh run."""
    if not config.resume:
        return None, {}
    if not run_dir:
        raise ValueError("resume=true needs the run directory of the run to resume")
    path, rejected = checkpoint.latest_valid(run_dir)
    if path is None:
        raise FileNotFoundError(f"resume=true: no valid checkpoint in {checkpoint.checkpoints_dir(run_dir)}"
                                + (f" (rejected: {'; '.join(rejected)})" if rejected else ""))
    saved_batches, held = checkpoint_parts.resumable_batches(checkpoint_parts.load_batches(os.path.join(path, "batches.msgpack")))
    learner_meta = checkpoint_parts.load_json(os.path.join(path, "learner.json"))
    point = ResumePoint(checkpoint=path, saved_batches=saved_batches, held_sample_ids=held,
                        weight_version=learner_meta["weight_version"],
                        incarnation=int(learner_meta.get("incarnation", 0)) + 1)
    return point, {"checkpoint": path, "rejected": rejected, "step": learner_meta["step"],
                   "weight_version": point.weight_version, "saved_batches": len(saved_batches)}
