"""The mechanisms that move the policy's weights from the learner to the generators; which one a
generator gets, and what each side does with it, is `asyncrl.weights.transport`.

The learner publishes each new version once and tells every generator how to fetch it (a
`Delivery`); the path of a generator is chosen from where it landed:

* `shm` (same host, CPU): the learner copies the version's tensors into one of two files in the
  node's shared memory, written in turn (`SharedSlots`); a generator on that node maps them once
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
import glob
import mmap
import os
import socket
import tempfile
import time
import uuid
import warnings
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
