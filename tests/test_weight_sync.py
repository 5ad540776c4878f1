"""Weight transfer (`asyncrl.weight_sync`): the distributed group (two real processes over gloo) and
shared memory (Ray's object store, a real engine adopting the views), through one interface."""

import time

import numpy as np
import pytest
import ray
import torch
import torch.multiprocessing as mp

from asyncrl.weight_sync import (Delivery, WeightGroup, WeightTransferError, choose_paths, free_port, plan_buckets,
                                 shared_views, to_shared)


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
        from asyncrl.models import build_tiny_model

        self.engine = TorchEngine(build_tiny_model(ModelConfig(source="tiny", seed=9), 30), eos_token_ids=[1])

    def adopt(self, delivery: Delivery, arrays) -> dict:
        self.engine.adopt_weights(shared_views(arrays), delivery.version, keepalive=arrays)
        params = dict(self.engine.model.named_parameters())
        return {"version": self.engine.version, "writeable": arrays["lm_head.weight"][2].flags.writeable,
                "sums": {n: float(p.double().sum()) for n, p in params.items()},
                "shares": params["lm_head.weight"].data_ptr() == arrays["lm_head.weight"][2].ctypes.data}

    def copy_then(self, weights: dict) -> float:
        self.engine.update_weights(weights.items(), 99)  # a copy after adopted views: replaced, not written
        return float(dict(self.engine.model.named_parameters())["lm_head.weight"].double().sum())


def test_the_shared_memory_path_hands_the_engine_views_without_a_copy(ray_session):
    from asyncrl.config import ModelConfig
    from asyncrl.models import build_tiny_model

    learner = build_tiny_model(ModelConfig(source="tiny", seed=3), 30)
    ref = to_shared(learner.named_parameters())
    holder = _Holder.remote()
    got = ray.get(holder.adopt.remote(Delivery(5, "shm"), ref))
    assert got["version"] == 5 and not got["writeable"] and got["shares"]  # a read-only mapping, not a copy
    expected = {n: float(p.detach().double().sum()) for n, p in learner.named_parameters()}
    assert got["sums"] == pytest.approx(expected, rel=1e-12)
    fresh = {n: torch.ones_like(p) for n, p in learner.named_parameters()}
    assert ray.get(holder.copy_then.remote(fresh)) == pytest.approx(float(np.prod(learner.lm_head.weight.shape)))
