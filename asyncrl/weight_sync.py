"""Weight broadcast from the policy learner (rank 0) to generators over `torch.distributed`.

The same code runs gloo on CPU and NCCL on GPU. Parameters are packed into fixed-size `uint8`
buckets (dtype-agnostic: gloo lacks bf16 collectives) and broadcast bucket by bucket; the bucket
plan (names, dtypes, shapes, offsets) travels out of band as a msgspec struct over a Ray call.

Rendezvous order matters (a wrong order deadlocks): receivers' `init_weight_group` calls are
issued first, then the sender joins, then the caller waits on the receivers.

Each process of a run joins exactly one weight group, so the group is the default process group
of that process (generators and a CPU learner have no other collective). A learner sharded with
FSDP would need a separate group; that is future work and would change only `init_weight_group`.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Iterable, Iterator

import msgspec
import torch
import torch.distributed as dist


class TensorSlot(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class Bucket(msgspec.Struct, frozen=True):
    nbytes: int
    slots: list[TensorSlot]


class BucketPlan(msgspec.Struct, frozen=True):
    buckets: list[Bucket]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> BucketPlan:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor gets its own)."""
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    used = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if slots and used + nbytes > bucket_bytes:
            buckets.append(Bucket(used, slots))
            slots, used = [], 0
        slots.append(TensorSlot(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), used, nbytes))
        used += nbytes
    if slots:
        buckets.append(Bucket(used, slots))
    return BucketPlan(buckets)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_weight_group(master_addr: str, master_port: int, world_size: int, rank: int, backend: str = "gloo",
                      timeout_s: float = 600.0) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def destroy_weight_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_weights(plan: BucketPlan, named_tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sender side (rank 0). Returns timing: pack and broadcast seconds, bytes."""
    device = _device()
    pack_s = comm_s = 0.0
    for bucket in plan.buckets:
        start = time.perf_counter()
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        for slot in bucket.slots:
            flat = named_tensors[slot.name].detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[slot.offset : slot.offset + slot.nbytes].copy_(flat)
        pack_s += time.perf_counter() - start
        start = time.perf_counter()
        dist.broadcast(buffer, src=0)
        comm_s += time.perf_counter() - start
    return {"pack_s": pack_s, "broadcast_s": comm_s, "bytes": float(plan.total_bytes)}


def receive_weights(plan: BucketPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: yields `(name, tensor)` views into each received bucket, bucket by bucket."""
    device = _device()
    for bucket in plan.buckets:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(buffer, src=0)
        for slot in bucket.slots:
            dtype = getattr(torch, slot.dtype)
            yield slot.name, buffer[slot.offset : slot.offset + slot.nbytes].view(dtype).view(slot.shape)
