"""Bucketed weight broadcast over a real gloo process group (two processes)."""

import torch
import torch.multiprocessing as mp

from asyncrl.weight_sync import broadcast_weights, free_port, init_weight_group, plan_buckets, receive_weights


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 70, generator=g),
        "b.bias": torch.randn(7, generator=g),
        "c.half": torch.randn(50, 3, generator=g).to(torch.bfloat16),  # gloo has no bf16 ops: sent as bytes
        "d.big": torch.randn(100_000, generator=g),
    }


def _receiver(port, plan, queue):
    init_weight_group("127.0.0.1", port, 2, 1)
    # Raw bytes back to the parent (tensors in a queue share memory with a process that exits).
    queue.put({name: (str(t.dtype), t.contiguous().view(torch.uint8).numpy().tobytes()) for name, t in receive_weights(plan)})


def test_broadcast_in_buckets_is_bit_exact():
    weights = _weights(0)
    plan = plan_buckets(weights.items(), bucket_bytes=50_000)  # several buckets; the big tensors get their own
    assert len(plan.buckets) >= 3
    assert plan.total_bytes == sum(t.numel() * t.element_size() for t in weights.values())
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, plan, queue))
    proc.start()
    init_weight_group("127.0.0.1", port, 2, 0)
    timing = broadcast_weights(plan, weights)
    received = queue.get(timeout=60)
    proc.join(timeout=60)
    torch.distributed.destroy_process_group()
    assert timing["bytes"] == plan.total_bytes
    for name, tensor in weights.items():
        dtype, raw = received[name]
        assert dtype == str(tensor.dtype) and raw == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name
