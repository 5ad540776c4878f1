"""Weight transfer (`asyncrl.weights.sync`): the distributed group (two real processes over gloo) and
shared memory (two slot files written in turn, a real engine in another process adopting views), through
one interface."""

import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import ray
import torch
import torch.multiprocessing as mp

from asyncrl.weights.shared_memory import SHARED_PREFIX, SharedSlots, SharedVersion, remove_orphaned_slots, shared_directory, shared_views
from asyncrl.weights.sync import Delivery, WeightGroup, WeightTransferError, free_port, plan_buckets
from asyncrl.weights.transport import choose_paths


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 70, generator=g),
        "b.bias": torch.randn(7, generator=g),
        "c.half": torch.randn(50, 3, generator=g).to(torch.bfloat16),  # gloo has no bf16 ops: sent as bytes
        "d.big": torch.randn(100_000, generator=g),
    }


def as_bytes(tensor: torch.Tensor) -> tuple[str, bytes]:
    return str(tensor.dtype), tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _receiver(port, plan, version, queue):
    group = WeightGroup("127.0.0.1", port, 2, 1, timeout_s=20, join_timeout_s=120)
    try:
        # Raw bytes back to the parent (tensors in a queue share memory with a process that exits).
        queue.put({name: as_bytes(t) for name, t in group.receive(plan, version)})
    except WeightTransferError as exc:
        queue.put(str(exc))


def run_group(plan, weights, sent_version, expected_version):
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, plan, expected_version, queue))
    proc.start()
    group = WeightGroup("127.0.0.1", port, 2, 0, timeout_s=20, join_timeout_s=120)
    try:
        timing = group.send(plan, weights, sent_version)
    except WeightTransferError as exc:
        timing = exc
    received = queue.get(timeout=120)
    proc.join(timeout=60)
    return timing, received


def test_the_group_path_is_bit_exact_in_buckets_that_split_the_weights():
    weights = _weights(0)
    plan = plan_buckets(weights.items(), bucket_bytes=50_000)  # several buckets; the big tensors get their own
    assert len(plan.buckets) >= 3
    assert plan.total_bytes == sum(t.numel() * t.element_size() for t in weights.values())
    timing, received = run_group(plan, weights, 7, 7)
    assert timing["bytes"] == plan.total_bytes
    assert received == {name: as_bytes(t) for name, t in weights.items()}


def test_a_receiver_expecting_another_version_fails_naming_both_and_the_sender_hears_of_it():
    weights = _weights(1)
    plan = plan_buckets(weights.items(), bucket_bytes=1 << 20)
    timing, received = run_group(plan, weights, 6, 7)
    assert received == f"weight group rank 1: expected version 7 ({plan.total_bytes} bytes), the learner sent version 6 ({plan.total_bytes} bytes)"
    assert isinstance(timing, WeightTransferError)  # the receiver left: the sender's broadcast fails, clearly


def test_a_rendezvous_nobody_joins_times_out_with_a_clear_error():
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match=r"rendezvous at 127\.0\.0\.1:\d+ \(rank 0 of 2\) failed within 1s"):
        WeightGroup("127.0.0.1", free_port(), 2, 0, join_timeout_s=1)
    assert time.monotonic() - start < 30


def test_paths_follow_where_the_actors_landed():
    assert choose_paths("n1", ["n1", "n2", "n1"], "cpu") == ["shm", "group", "shm"]
    assert choose_paths("n1", ["n1"], "cuda") == ["cuda_ipc"]
    assert choose_paths("n1", ["n1", "n2"], "cpu", "group") == ["group", "group"]
    with pytest.raises(ValueError, match="does not fit"):
        choose_paths("n1", ["n1"], "cpu", "cuda_ipc")


@ray.remote(num_cpus=0)
class _Holder:
    """A generator-like process on the same node: adopts shared weights into a real engine."""

    def __init__(self):
        from asyncrl.config import ModelConfig
        from asyncrl.engines.torch_engine import TorchEngine
        from asyncrl.models.loading import build_tiny_model

        self.engine = TorchEngine(build_tiny_model(ModelConfig(source="tiny", seed=9), 30), eos_token_ids=[1])

    def adopt(self, delivery: Delivery, shared: SharedVersion) -> dict:
        views = shared_views(shared)
        self.engine.adopt_weights(views, delivery.weight_version, keepalive=views)
        return {"version": self.engine.weight_version, **self.sums()}

    def sums(self) -> dict:
        params = dict(self.engine.model.named_parameters())
        return {"sums": {n: float(p.double().sum()) for n, p in params.items()},
                "writeable": _writeable(params["lm_head.weight"])}

    def copy_then(self, weights: dict) -> float:
        self.engine.update_weights(weights.items(), 99)  # a copy after adopted views: replaced, not written
        return float(dict(self.engine.model.named_parameters())["lm_head.weight"].double().sum())


def _writeable(tensor: torch.Tensor) -> bool:
    """Whether the memory under `tensor` accepts a write (this process's mapping of it, with its
    permissions and file, from /proc/self/maps)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                assert SHARED_PREFIX in line, line  # a view of the slot file, not a private copy
                return "w" in fields[1]
    raise AssertionError(f"address {address:#x} in no mapping")


def _sums(weights) -> dict:
    return {n: float(p.detach().double().sum()) for n, p in weights}


def test_the_shared_memory_path_hands_the_engine_views_without_a_copy(ray_session):
    from asyncrl.config import ModelConfig
    from asyncrl.models.loading import build_tiny_model

    learner = build_tiny_model(ModelConfig(source="tiny", seed=3), 30)
    slots = SharedSlots()
    holder = _Holder.remote()
    try:
        first = slots.write(learner.named_parameters())
        # /dev/shm where it has room (a container's default 64 MB may not: then the temporary directory).
        assert os.path.dirname(first.path) == shared_directory(2 * first.nbytes)
        assert os.path.basename(first.path).startswith(f"{SHARED_PREFIX}-{os.getpid()}-")
        got = ray.get(holder.adopt.remote(Delivery(5, "shm"), first))
        assert got["version"] == 5 and not got["writeable"]  # a read-only shared mapping, not a copy
        assert got["sums"] == pytest.approx(_sums(learner.named_parameters()), rel=1e-12)

        # Two slots in turn: version 6 goes to the other file while the generator still views 5's.
        with torch.no_grad():
            learner.lm_head.weight.add_(1.0)
        second = slots.write(learner.named_parameters())
        assert second.path != first.path
        assert ray.get(holder.sums.remote())["sums"] == pytest.approx(got["sums"], rel=1e-12)  # 5 untouched
        got6 = ray.get(holder.adopt.remote(Delivery(6, "shm"), second))
        assert got6["sums"] == pytest.approx(_sums(learner.named_parameters()), rel=1e-12)
        # Version 7 rewrites the first file (free: the generator holds 6), and lands whole.
        with torch.no_grad():
            learner.lm_head.weight.mul_(2.0)
        third = slots.write(learner.named_parameters())
        assert third.path == first.path
        assert ray.get(holder.sums.remote())["sums"] == pytest.approx(got6["sums"], rel=1e-12)  # 6 untouched
        assert ray.get(holder.adopt.remote(Delivery(7, "shm"), third))["sums"] == pytest.approx(
            _sums(learner.named_parameters()), rel=1e-12)

        # A failed delivery: which slot a generator views is unknown, so new files take over.
        slots.invalidate()
        fourth = slots.write(learner.named_parameters())
        assert fourth.path not in (first.path, second.path) and not os.path.exists(first.path)
        assert ray.get(holder.sums.remote())["sums"] == pytest.approx(_sums(learner.named_parameters()), rel=1e-12)

        fresh = {n: torch.ones_like(p) for n, p in learner.named_parameters()}
        assert ray.get(holder.copy_then.remote(fresh)) == pytest.approx(float(np.prod(learner.lm_head.weight.shape)))
    finally:
        slots.close()
    assert not os.path.exists(fourth.path)
    # Closed (the learner stopped): a late version would leave files nobody removes.
    with pytest.raises(WeightTransferError, match="closed"):
        slots.write(learner.named_parameters())
    slots.open()
    fifth = slots.write(learner.named_parameters())
    slots.close()
    assert not os.path.exists(fifth.path)


def test_slot_files_of_a_learner_that_is_gone_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = tmp_path / f"{SHARED_PREFIX}-{int(gone.stdout)}-0-1", tmp_path / f"{SHARED_PREFIX}-{os.getpid()}-0-0"
    other = tmp_path / "someone-elses-file"
    for path in (dead, alive, other):
        path.write_bytes(b"x")
    assert remove_orphaned_slots(str(tmp_path)) == 1
    assert not dead.exists() and alive.exists() and other.exists()


def test_slots_that_do_not_fit_in_dev_shm_go_to_the_temporary_directory():
    assert shared_directory(1 << 50) == tempfile.gettempdir()
    assert shared_directory(1 << 20) in ("/dev/shm", tempfile.gettempdir())
