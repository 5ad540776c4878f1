"""The mechanisms that move the policy's weights from the learner to the generators; which one a
generator gets, and what each side does with it, is `asyncrl.weights.transport`.

The learner publishes each new version once and tells every generator how to fetch it (a
`Delivery`); the path of a generator is chosen from where it landed:

* `shm` (same host, CPU): the learner copies the version's tensors into one of two files in the
  node's shared memory, written in turn (`asyncrl.weights.shared_memory`); a generator on that node maps them once
  and its engine adopts views as its parameters between windows. No TCP, no second copy.
* `cuda_ipc` (same host, CUDA): tensors passed by CUDA IPC handle (`torch.multiprocessing`'s
  reductions; SGLang's `update_weights_from_tensor` takes the same handles).
* `group` (another host): a `torch.distributed` group of the learner (rank 0) and those generators,
  NCCL on GPU, gloo on CPU, made as its own process group (not the default one, so a sharded
  learner keeps its own collectives). Its rendezvous is the learner's node IP and a port free
  there. Tensors travel in fixed-size `uint8` buckets (dtype-agnostic: gloo lacks bf16 collectives)
  after a header that names the version, so a receiver expecting another version fails clearly.
  Every collective has a timeout.

Rendezvous order matters for the group (a wrong order deadlocks): receivers' joins are issued
first, then the sender joins, then the caller waits on the receivers.
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


class AdapterSpec(msgspec.Struct, frozen=True):
    """A version sent as a LoRA adapter (`asyncrl.weights.lora`): its tensors are `<module>.lora_A` and
    `<module>.lora_B`, merged by the generator as W0 + (alpha / rank) * B @ A."""

    rank: int
    alpha: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class Delivery(msgspec.Struct, frozen=True):
    """How one version reaches one generator: its path (`asyncrl.weights.transport`), and for `group` the
    bucket plan. `adapter`: the tensors are a LoRA adapter. `delta_base` (`policy.weight_delta`):
    None when deltas are off; -1 for a whole version in the engine's dtype (kept as the engine's
    own copy, which later deltas change); else the version the tensors are a delta from
    (`asyncrl.weights.delta`)."""

    weight_version: int
    path: str
    plan: BucketPlan | None = None
    adapter: AdapterSpec | None = None
    delta_base: int | None = None


class WeightTransferError(RuntimeError):
    """A weight update that cannot complete: a timeout, a peer gone, another version than expected."""


def tensor_slot(name: str, tensor: torch.Tensor, offset: int) -> TensorSlot:
    """Where `tensor` lies in a flat byte buffer, with what rebuilds it (its dtype by name)."""
    return TensorSlot(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset,
                      tensor.numel() * tensor.element_size())


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> BucketPlan:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor gets its own).
    Each offset is a multiple of its tensor's element size (a receiver views the bytes as that
    dtype): tensors of mixed sizes, a delta's int32 indices after bf16 values, get padding."""
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    used = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        aligned = -(-used // tensor.element_size()) * tensor.element_size()
        if slots and aligned + nbytes > bucket_bytes:
            buckets.append(Bucket(used, slots))
            slots, aligned = [], 0
        slots.append(tensor_slot(name, tensor, aligned))
        used = aligned + nbytes
    if slots:
        buckets.append(Bucket(used, slots))
    return BucketPlan(buckets)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on this host (call it on the host that will listen)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_address() -> str:
    """This process's node IP as Ray sees it (the address other nodes reach it at)."""
    import ray

    return ray.util.get_node_ip_address()


# --- shared memory (same host, CPU) ---------------------------------------------------------------


def to_cuda_ipc(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """CUDA IPC handles of a version's tensors (`torch.multiprocessing.reductions.reduce_tensor`):
    a process on the same host rebuilds them without a copy. The sender must keep the tensors alive
    until every receiver has loaded them."""
    from torch.multiprocessing.reductions import reduce_tensor

    return {name: reduce_tensor(t.detach().contiguous()) for name, t in named_tensors}


def from_cuda_ipc(handles: dict, device: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `to_cuda_ipc` in this process (on `device`, default the sender's index)."""
    for name, (rebuild, args) in handles.items():
        args = list(args)
        if device is not None:
            args[6] = device  # rebuild_cuda_tensor's storage_device
        yield name, rebuild(*args)


# --- the distributed group (other hosts) -----------------------------------------------------------


class WeightGroup:
    """A `torch.distributed` process group of its own (not the default group): the learner is
    rank 0, the generators on other hosts ranks 1..N. gloo on CPU, NCCL on GPU."""

    HEADER_BYTES = 16  # int64 version, int64 total bytes

    def __init__(self, host: str, port: int, world_size: int, rank: int, backend: str = "gloo",
                 timeout_s: float = 300.0, join_timeout_s: float = 600.0, name: str = "asyncrl-weights",
                 local_address: str | None = None):
        """`timeout_s` bounds every collective; `join_timeout_s` the rendezvous (all ranks connected).
        `local_address`: the address this rank is reached at (its node IP; gloo's default, the
        hostname's address, may be one that other hosts cannot reach)."""
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s
        join = datetime.timedelta(seconds=join_timeout_s)
        try:
            store = dist.PrefixStore(name, dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=join,
                                                         wait_for_workers=False))
            if backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = datetime.timedelta(seconds=timeout_s)
                self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
                self.device = torch.device("cuda", torch.cuda.current_device())
            elif backend == "gloo":
                options = dist.ProcessGroupGloo._Options()
                options._timeout = join
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)
                                    if local_address else dist.ProcessGroupGloo.create_default_device()]
                self.pg = dist.ProcessGroupGloo(store, rank, world_size, options)  # connects the full mesh
                self.device = torch.device("cpu")
            else:
                raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
        except (RuntimeError, dist.DistNetworkError, dist.DistStoreError) as exc:
            raise WeightTransferError(f"weight group rendezvous at {host}:{port} (rank {rank} of {world_size}) "
                                      f"failed within {join_timeout_s:.0f}s: {str(exc).splitlines()[0]}") from exc
        self._store = store  # kept alive with the group

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            self.pg.broadcast([tensor], opts).wait()
        except RuntimeError as exc:
            raise WeightTransferError(f"weight group rank {self.rank}: broadcast of {what} failed or timed out "
                                      f"after {self.timeout_s:.0f}s (a peer gone?): {str(exc).splitlines()[0]}") from exc

    def send(self, plan: BucketPlan, named_tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Rank 0: the header, then each bucket. Returns pack and broadcast seconds and bytes."""
        self._broadcast(torch.tensor([version, plan.total_bytes], dtype=torch.int64, device=self.device), "the header")
        pack_s = comm_s = 0.0
        for i, bucket in enumerate(plan.buckets):
            start = time.perf_counter()
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
            for slot in bucket.slots:
                flat = named_tensors[slot.name].detach().contiguous().reshape(-1).view(torch.uint8)
                buffer[slot.offset: slot.offset + slot.nbytes].copy_(flat)
            pack_s += time.perf_counter() - start
            start = time.perf_counter()
            self._broadcast(buffer, f"bucket {i} of version {version}")
            comm_s += time.perf_counter() - start
        return {"pack_s": pack_s, "broadcast_s": comm_s, "bytes": float(plan.total_bytes)}

    def receive(self, plan: BucketPlan, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks 1..N: `(name, tensor)` views into each received bucket, after checking the header."""
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._broadcast(header, "the header")
        sent_version, sent_bytes = (int(x) for x in header.tolist())
        if (sent_version, sent_bytes) != (version, plan.total_bytes):
            raise WeightTransferError(f"weight group rank {self.rank}: expected version {version} "
                                      f"({plan.total_bytes} bytes), the learner sent version {sent_version} "
                                      f"({sent_bytes} bytes)")
        for i, bucket in enumerate(plan.buckets):
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
            self._broadcast(buffer, f"bucket {i} of version {version}")
            for slot in bucket.slots:
                dtype = getattr(torch, slot.dtype)
                yield slot.name, buffer[slot.offset: slot.offset + slot.nbytes].view(dtype).view(slot.shape)

    def close(self) -> None:
        self.pg = None
