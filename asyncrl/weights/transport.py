"""How a weight version travels from the policy learner to each generator: the one place that
names the paths and says what each side does on each.

* `shm`: generators on the learner's node (CPU) map two slot files in shared memory that the
  learner writes in turn (`asyncrl.weights.shared_memory.SharedSlots`); adopting a version is a pointer swap.
* `cuda_ipc`: generators on the learner's GPU rebuild the learner's tensors from CUDA IPC handles.
* `group`: generators on other nodes receive bucketed broadcasts over a `torch.distributed` group
  of their own (`asyncrl.weights.sync.WeightGroup`: gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

import torch

from asyncrl.weights.delta import DeltaTracker
from asyncrl.weights.shared_memory import SharedSlots, SharedVersion, shared_views
from asyncrl.weights.sync import AdapterSpec, BucketPlan, Delivery, WeightGroup, from_cuda_ipc, plan_buckets, to_cuda_ipc

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
    plan: BucketPlan | None = None  # a delta's own plan (the sender's fixed one otherwise)
    delta_base: int | None = None  # `Delivery.delta_base`
    delta: dict | None = None  # a delta's counts (`asyncrl.weights.delta.encode`)


class WeightSender:
    """The learner's side: stage a version (a consistent copy for each path in use), then deliver.

    Generators come and go (an elastic pool): each has its path, and each generator on another
    node its own group with the learner (two members), so a generator that dies, hangs or leaves
    breaks no one else's delivery, and one that joins needs no one else to meet again. The price:
    the learner sends the bytes once per remote generator instead of one broadcast to all.

    What a version is: every weight; with `adapter` a LoRA adapter (`asyncrl.weights.lora`); with `delta`
    (`policy.weight_delta`) what changed since the version every generator holds, in the engine's
    dtype (`asyncrl.weights.delta`)."""

    def __init__(self, plan: BucketPlan, adapter: AdapterSpec | None = None, delta: DeltaTracker | None = None,
                 bucket_bytes: int = 64 << 20):
        self.plan = plan
        self.adapter = adapter
        self.delta = delta
        self.bucket_bytes = bucket_bytes
        self.paths: dict[str, str] = {}  # generator id -> its path
        self.groups: dict[str, WeightGroup] = {}  # generator id -> its group (rank 0: the learner)
        self.slots = SharedSlots()  # the shm path's two files (made at the first delivery)
        # The version the shm generators view now: a generator joining on shm views the same slot
        # (writing it into the other slot would let the next version overwrite what they view).
        self.last_shared: Staged | None = None

    def needs_whole_copy(self, paths: Iterable[str] | None = None) -> bool:
        """The group and CUDA IPC paths send a copy taken between two steps; shm writes the live weights."""
        return bool({"group", "cuda_ipc"} & set(self.paths.values() if paths is None else paths))

    def stage(self, version: int, parameters: Iterable[tuple[str, torch.Tensor]],
              whole: dict[str, torch.Tensor] | None, paths: Iterable[str] | None = None) -> Staged:
        """Take the version's copy (call it under the learner's weights lock) for `paths` (default:
        every generator's): into the shared slots for the shm path; `whole` (a copy by name) for the
        group and CUDA IPC paths."""
        paths = set(self.paths.values() if paths is None else paths)
        staged = Staged(version, whole=whole)
        if self.delta is not None:
            pieces, staged.delta_base, staged.delta = self.delta.stage(
                version, whole.items() if whole is not None else parameters)
            staged.whole, staged.plan = dict(pieces), plan_buckets(pieces, self.bucket_bytes)
            whole = staged.whole
        if "shm" in paths:
            staged.shared = self.slots.write(whole.items() if whole is not None else parameters)
            self.last_shared = Staged(version, shared=staged.shared)
        if "cuda_ipc" in paths:
            staged.whole = {name: t.cuda() for name, t in whole.items()}  # a no-op unless gathered to CPU
            staged.handles = to_cuda_ipc(staged.whole.items())
        return staged

    def delivery(self, staged: Staged, path: str) -> tuple[Delivery, object]:
        """What a generator on `path` is sent: the delivery notice and its payload."""
        payload = {"shm": staged.shared, "cuda_ipc": staged.handles, "group": None}[path]
        plan = (staged.plan or self.plan) if path == "group" else None
        return Delivery(staged.version, path, plan, self.adapter, staged.delta_base), payload

    def bytes_of(self, staged: Staged) -> int:
        return (staged.plan or self.plan).total_bytes

    def send_group(self, staged: Staged, generator_id: str) -> dict[str, float]:
        """Send the version to one remote generator over its group (it receives at the same time)."""
        return self.groups[generator_id].send(staged.plan or self.plan, staged.whole, staged.version)

    def remove(self, generator_id: str) -> None:
        self.paths.pop(generator_id, None)
        group = self.groups.pop(generator_id, None)
        if group is not None:
            group.close()

    def failed(self) -> None:
        """A delivery failed: a generator may still view the slot the next version would take (and,
        with deltas, may not hold the version the next delta would start from)."""
        self.slots.invalidate()
        self.last_shared = None
        if self.delta is not None:
            self.delta.reset()


def load(engine, delivery: Delivery, payload, group: WeightGroup | None) -> None:
    """The generator's side: take `delivery.weight_version` into `engine` by its path (between
    windows, or while they run where the engine takes updates mid-window: SGLang). On shm the
    engine gets the slot's layout (`Engine.adopt_shared`): the embedded engine views it, SGLang's
    scheduler maps the file itself. An adapter is merged by the engine (`Engine.load_adapter`), a
    delta applied to the copy of the weights it holds (`Engine.apply_delta`); a whole version in
    delta mode is copied (`Engine.hold_version`: later deltas write into it), never viewed."""
    version = delivery.weight_version
    if delivery.path == "shm" and delivery.adapter is None and delivery.delta_base is None:
        engine.adopt_shared(payload, version)
        return
    if delivery.path == "shm":
        named = shared_views(payload)
    elif delivery.path == "cuda_ipc":
        named = from_cuda_ipc(payload)
    elif delivery.path == "group":
        if group is None:
            raise RuntimeError("a group delivery, but this generator joined no weight group")
        named = group.receive(delivery.plan, version)
    else:
        raise ValueError(f"unknown weight path {delivery.path!r}")
    if delivery.adapter is not None:
        engine.load_adapter(named, delivery.adapter, version)
    elif delivery.delta_base is not None and delivery.delta_base >= 0:
        engine.apply_delta(named, delivery.delta_base, version)
    elif delivery.delta_base is not None:
        engine.hold_version(named, version)
    else:
        engine.update_weights(named, version)


class WeightReceivers:
    """The generators a learner delivers its versions to, as they join and leave: a fan-out of
    weight deliveries, with the failed ones reported.

    One delivery at a time (the learner's loop, or a generator joining): the newest version when
    several piled up. `on_delivered(version, timing)` says the newest version every receiver holds,
    and only a version some receiver took: a learner that lost every receiver announces nothing
    until a generator joins (it gets the current version, then that is announced; timing is None for
    a join). A generator whose delivery fails or takes longer than `timeout_s` stops being a receiver
    (`failed` says why, and the run's generator pool heals what is listed there: `asyncrl.run.pool`):
    the others are never held up by it. A joining generator gets the current version before it is
    added, so its first prompt is generated by current weights."""

    def __init__(self, sender: WeightSender, stage: Callable[[set[str]], Awaitable[Staged]],
                 on_delivered: Callable[[int, dict], None], generators: dict[str, Any] | None = None,
                 timeout_s: float = 300.0):
        self.sender, self.stage, self.on_delivered = sender, stage, on_delivered
        self.generators: dict[str, Any] = generators if generators is not None else {}  # id -> actor handle
        self.failed: dict[str, str] = {}  # generator id -> why a delivery to it failed (the newest 100)
        self.held: dict[str, int] = {}  # generator id -> the version it took last
        self.had_members = False  # a generator ever joined (a learner without any announces its own versions)
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._wanted = False
        self._task: asyncio.Task | None = None
        self._waiting: dict[str, asyncio.Future] = {}  # generator id -> its delivery in flight

    def request(self) -> None:
        """Deliver the newest version to every receiver (in the background; a request made while a
        delivery runs is served by the next one)."""
        if not self.generators:
            return
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while self._wanted:
            self._wanted = False
            async with self._lock:
                start = time.perf_counter()
                version, timing, paused = await self._deliver(dict(self.generators))
            self._announce({**timing, "version": version, "total_s": time.perf_counter() - start,
                            "paths": sorted(set(self.sender.paths.values())),
                            "generator_pause_s_max": max(paused, default=0.0)})

    def _announce(self, timing: dict | None) -> None:
        """The newest version every receiver holds (none announced when there is no receiver: none
        took anything)."""
        held = [self.held[gid] for gid in self.generators if gid in self.held]
        if held and len(held) == len(self.generators):
            self.on_delivered(min(held), timing)

    async def _deliver(self, generators: dict[str, Any], staged: Staged | None = None
                       ) -> tuple[int, dict[str, float], list[float]]:
        """The current version (or `staged`) to `generators`: send each its delivery, wait for them."""
        paths = {gid: self.sender.paths[gid] for gid in generators}
        staged = staged or await self.stage(set(paths.values()))
        deliveries = {gid: asyncio.ensure_future(asyncio.wait_for(
            handle.receive_weights.remote(*self.sender.delivery(staged, paths[gid])), self.timeout_s))
            for gid, handle in generators.items()}
        self._waiting.update(deliveries)
        timing = {"bytes": float(self.sender.bytes_of(staged))}
        if staged.delta is not None:
            timing.update({f"delta_{key}": float(value) for key, value in staged.delta.items()})
        for gid in [gid for gid, path in paths.items() if path == "group"]:
            try:
                timing = await asyncio.to_thread(self.sender.send_group, staged, gid)
            except Exception as exc:  # its group broke (the peer gone): it leaves; the others go on
                self._fail(gid, exc)
            if staged.delta is not None:
                timing.update({f"delta_{key}": float(value) for key, value in staged.delta.items()})
        results = await asyncio.gather(*deliveries.values(), return_exceptions=True)
        for gid in deliveries:
            self._waiting.pop(gid, None)
        paused = []
        for gid, result in zip(deliveries, results):
            if isinstance(result, BaseException):
                self._fail(gid, result)
            elif gid in self.sender.paths:  # not removed meanwhile
                self.held[gid] = staged.version
                paused.append(result)
        return staged.version, timing, paused

    def _fail(self, generator_id: str, exc: BaseException) -> None:
        if generator_id in self.generators or generator_id in self.sender.paths:
            self.failed[generator_id] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]
            while len(self.failed) > 100:
                self.failed.pop(next(iter(self.failed)))
            self.remove(generator_id)
            self.sender.failed()

    async def add(self, generator_id: str, handle: Any, path: str) -> int:
        """`generator_id` joins: the current version first, then every later one. Returns that version."""
        async with self._lock:
            self.sender.paths[generator_id] = path
            shared = self.sender.last_shared if path == "shm" and self.sender.delta is None else None
            if self.sender.delta is not None:  # a whole version for it, then for every generator
                self.sender.delta.reset()
            version, _, _ = await self._deliver({generator_id: handle}, staged=shared)
            if self.sender.delta is not None:
                self.sender.delta.reset()
            if generator_id in self.failed:
                raise RuntimeError(f"{generator_id} could not load version {version}: {self.failed[generator_id]}")
            self.generators[generator_id] = handle
            self.had_members = True
            self._announce(None)
        return version

    def remove(self, generator_id: str) -> None:
        """`generator_id` leaves (it drained, died or hung): no delivery waits for it again."""
        self.generators.pop(generator_id, None)
        self.held.pop(generator_id, None)
        self.sender.remove(generator_id)
        waiting = self._waiting.pop(generator_id, None)
        if waiting is not None:
            waiting.cancel()  # a delivery in flight no longer waits for it
