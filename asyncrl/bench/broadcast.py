"""Weight broadcast cost: the learner's bucketed gloo broadcast (`asyncrl.weight_sync`) to a
generator process that loads every tensor into its model copy, against a plain memory copy of the
same bytes (the ceiling: a broadcast moves each byte at least once). Paired rounds.

Models: the embedded SmolLM2-135M (its real weights) and a 0.5B-parameter model with random
weights (Qwen2.5-0.5B's shapes). The share of training wall time spent on updates is measured in
training runs (`generator_paused_for_weights_fraction`, `asyncrl bench utilisation`); this
benchmark reports it for a given learner step time as seconds per update / step time.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.multiprocessing as mp

from asyncrl.weight_sync import broadcast_weights, destroy_weight_group, free_port, init_weight_group, plan_buckets, receive_weights

# Qwen2.5-0.5B's architecture (494M parameters, tied embeddings), random weights.
HALF_B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def shapes_of(model_name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Parameter names and shapes, built on the meta device (no memory, no init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_name == "0.5b":
        config = AutoConfig.for_model(**HALF_B)
    elif model_name == "embedded":
        from asyncrl.config import compose
        from asyncrl.models import load_policy

        model, _ = load_policy(compose([]).model)
        return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    elif model_name == "tiny":
        from asyncrl.config import compose
        from asyncrl.models import load_policy

        model, _ = load_policy(compose(["model=tiny"]).model)
        return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    else:
        raise ValueError(f"unknown model {model_name!r}: embedded, 0.5b or tiny")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}


def random_tensors(shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in shapes.items()}


def _receiver(port: int, plan, shapes: dict, rounds: int, results) -> None:
    torch.set_num_threads(1)
    model = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in shapes.items()}
    init_weight_group("127.0.0.1", port, 2, 1)
    times = []
    for _ in range(rounds):
        torch.distributed.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            for name, tensor in receive_weights(plan):  # what the engine's update_weights does
                model[name].copy_(tensor)
        times.append(time.perf_counter() - start)
    checksum = float(sum(t.double().sum() for t in model.values()))
    destroy_weight_group()
    results.put({"receive_and_load_s": times, "checksum": checksum})


def measure(model_name: str, rounds: int, bucket_mb: int = 64) -> dict:
    torch.set_num_threads(1)
    shapes = shapes_of(model_name)
    weights = random_tensors(shapes)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    plan = plan_buckets(weights.items(), bucket_mb << 20)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_receiver, args=(port, plan, shapes, rounds, results))
    proc.start()
    init_weight_group("127.0.0.1", port, 2, 0)
    source = torch.empty(total, dtype=torch.uint8)
    target = torch.empty(total, dtype=torch.uint8)
    target.copy_(source)  # touch the pages once
    send, memcpy = [], []
    for _ in range(rounds):  # paired: broadcast, then the memory copy of the same bytes
        torch.distributed.barrier()
        start = time.perf_counter()
        broadcast_weights(plan, weights)
        send.append(time.perf_counter() - start)
        start = time.perf_counter()
        target.copy_(source)
        memcpy.append(time.perf_counter() - start)
    received = results.get(timeout=600)
    proc.join(timeout=60)
    destroy_weight_group()
    expected = float(sum(t.double().sum() for t in weights.values()))
    if abs(received["checksum"] - expected) > 1e-6 * max(1.0, abs(expected)):
        raise RuntimeError(f"received weights differ: checksum {received['checksum']} != {expected}")
    update = [max(s, r) for s, r in zip(send, received["receive_and_load_s"])]
    return {
        "parameters": sum(t.numel() for t in weights.values()), "bytes": total, "buckets": len(plan.buckets),
        "bucket_mb": bucket_mb, "rounds": rounds,
        "seconds_per_update_median": statistics.median(update),
        "sender_s_median": statistics.median(send),
        "receiver_s_median": statistics.median(received["receive_and_load_s"]),
        "bytes_per_s_median": total / statistics.median(update),
        "memcpy_s_median": statistics.median(memcpy),
        "memcpy_bytes_per_s_median": total / statistics.median(memcpy),
        "ratio_update_over_memcpy_median": statistics.median(u / m for u, m in zip(update, memcpy)),
    }


def run(quick: bool = False, overrides: list[str] | None = None, step_seconds: dict[str, float] | None = None) -> dict:
    """`overrides` are not used: the models are fixed by name (embedded, 0.5b; tiny with --quick)."""
    models = ("tiny", "embedded") if quick else ("embedded", "0.5b")
    rounds = 3 if quick else 5
    out = {}
    for name in models:
        out[name] = measure(name, rounds)
        step = (step_seconds or {}).get(name)
        if step:
            out[name]["learner_step_s"] = step
            out[name]["fraction_of_step"] = out[name]["seconds_per_update_median"] / step
        print(name, out[name], flush=True)
    return out


def report(result: dict) -> str:
    lines = ["| model | parameters | bytes | s / update | GB/s | memcpy s | memcpy GB/s | update / memcpy |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in result.items():
        lines.append(f"| {name} | {r['parameters'] / 1e6:.1f}M | {r['bytes'] / 1e6:.0f} MB | "
                     f"{r['seconds_per_update_median']:.3f} | {r['bytes_per_s_median'] / 1e9:.2f} | "
                     f"{r['memcpy_s_median']:.3f} | {r['memcpy_bytes_per_s_median'] / 1e9:.2f} | "
                     f"{r['ratio_update_over_memcpy_median']:.1f}x |")
    return "\n".join(lines)
