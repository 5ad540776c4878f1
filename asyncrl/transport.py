"""How a weight version travels from the policy learner to each generator: the one place that
names the paths and says what each side does on each.

* `shm`: generators on the learner's node (CPU) map two slot files in shared memory that the
  learner writes in turn (`asyncrl.weight_sync.SharedSlots`); adopting a version is a pointer swap.
* `cuda_ipc`: generators on the learner's GPU rebuild the learner's tensors from CUDA IPC handles.
* `group`: generators on other nodes receive bucketed broadcasts over a `torch.distributed` group
  of their own (`asyncrl.weight_sync.WeightGroup`: gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from asyncrl.weight_sync import (BucketPlan, Delivery, SharedSlots, SharedVersion, WeightGroup, from_cuda_ipc,
                                 shared_views, to_cuda_ipc)

PATHS = ("shm", "cuda_ipc", "group")


def choose_paths(learner_node: str, generator_nodes: list[str], device: str, setting: str = "auto") -> list[str]:
    """Each generator's path: on the learner's node, shared memory (CPU) or CUDA IPC (CUDA); on
    another node, the distributed group. `setting` other than auto forces one path where it can
    work (`group` works everywhere; `shm`/`cuda_ipc` only on the learner's node)."""
    if setting not in ("auto", *PATHS):
        raise ValueError(f"policy.weight_transport must be auto or one of {PATHS}, got {setting!r}")
    local = "cuda_ipc" if device == "cuda" else "shm"
    paths = []
    for node in generator_nodes:
        if setting == "group" or node != learner_node:
            paths.append("group")
        elif setting in ("auto", local):
            paths.append(local)
        else:
            raise ValueError(f"policy.weight_transport={setting} does not fit a {device} learner")
    return paths


@dataclass
class Staged:
    """One version ready to deliver: what each path sends."""

    version: int
    shared: SharedVersion | None = None  # shm
    whole: dict[str, torch.Tensor] | None = None  # group (and the tensors behind the CUDA IPC handles)
    handles: dict | None = None  # cuda_ipc


class WeightSender:
    """The learner's side: stage a version (a consistent copy for each path in use), then deliver."""

    def __init__(self, plan: BucketPlan):
        self.plan = plan
        self.paths: list[str] = []  # each generator's path, in the generators' order
        self.group: WeightGroup | None = None  # rank 0 of the group of generators on other nodes
        self.slots = SharedSlots()  # the shm path's two files (made at the first delivery)

    def needs_whole_copy(self) -> bool:
        """The group and CUDA IPC paths send a copy taken between two steps; shm writes the live weights."""
        return bool({"group", "cuda_ipc"} & set(self.paths))

    def stage(self, version: int, parameters: Iterable[tuple[str, torch.Tensor]],
              whole: dict[str, torch.Tensor] | None) -> Staged:
        """Take the version's copy (call it under the learner's weights lock): into the shared slots
        for the shm path; `whole` (a copy by name) for the group and CUDA IPC paths."""
        staged = Staged(version, whole=whole)
        if "shm" in self.paths:
            staged.shared = self.slots.write(whole.items() if whole is not None else parameters)
        if "cuda_ipc" in self.paths:
            staged.whole = {name: t.cuda() for name, t in whole.items()}  # a no-op unless gathered to CPU
            staged.handles = to_cuda_ipc(staged.whole.items())
        return staged

    def delivery(self, staged: Staged, path: str) -> tuple[Delivery, object]:
        """What a generator on `path` is sent: the delivery notice and its payload."""
        payload = {"shm": staged.shared, "cuda_ipc": staged.handles, "group": None}[path]
        return Delivery(staged.version, path, self.plan if path == "group" else None), payload

    def send_group(self, staged: Staged) -> dict[str, float]:
        """Broadcast the version to the group (its members receive at the same time); timing."""
        if "group" not in self.paths:
            return {"bytes": float(self.plan.total_bytes)}
        return self.group.send(self.plan, staged.whole, staged.version)

    def failed(self) -> None:
        """A delivery failed: a generator may still view the slot the next version would take."""
        self.slots.invalidate()


def load(engine, delivery: Delivery, payload, group: WeightGroup | None) -> None:
    """The generator's side: take `delivery.weight_version` into `engine` by its path (between windows)."""
    if delivery.path == "shm":
        views = shared_views(payload)
        engine.adopt_weights(views, delivery.weight_version, keepalive=views)
    elif delivery.path == "cuda_ipc":
        engine.update_weights(from_cuda_ipc(payload), delivery.weight_version)
    elif delivery.path == "group":
        if group is None:
            raise RuntimeError("a group delivery, but this generator joined no weight group")
        engine.update_weights(group.receive(delivery.plan, delivery.weight_version), delivery.weight_version)
    else:
        raise ValueError(f"unknown weight path {delivery.path!r}")
