"""Weight update cost, by path (`asyncrl.weights.sync`), against a plain memory copy of the same
bytes (the ceiling: an update moves each byte at least once). Paired rounds.

* `shm` (a generator on the learner's node): the learner puts the weights into shared memory (Ray's
  object store) and a generator process's engine adopts views of them (`TorchEngine.adopt_weights`).
* `group` (a generator on another node): the bucketed gloo broadcast of the learner's own process
  group to a generator process that copies every tensor into its model.
* `cuda_ipc` (with a GPU only): IPC handles of the learner's CUDA tensors to a second process that
  copies them into its own CUDA parameters, against a device-to-device copy of the same bytes.

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

from asyncrl.bench.common import HALF_B, ONE_HALF_B
from asyncrl.config import compose
from asyncrl.weights.shared_memory import SharedSlots, SharedVersion, shared_views
from asyncrl.weights.sync import Delivery, WeightGroup, free_port, from_cuda_ipc, plan_buckets, to_cuda_ipc

def shapes_of(model_name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Parameter names and shapes, built on the meta device (no memory, no init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_name in ("0.5b", "1.5b"):
        config = AutoConfig.for_model(**(HALF_B if model_name == "0.5b" else ONE_HALF_B))
    elif model_name == "embedded":
        from asyncrl.models.loading import load_policy

        model, _ = load_policy(compose([]).model)
        return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    elif model_name == "tiny":
        from asyncrl.models.loading import load_policy

        model, _ = load_policy(compose(["model=tiny"]).model)
        return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    else:
        raise ValueError(f"unknown model {model_name!r}: embedded, 0.5b, 1.5b or tiny")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}


def random_tensors(shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in shapes.items()}


def _receiver(port: int, plan, shapes: dict, rounds: int, results) -> None:
    torch.set_num_threads(1)
    model = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in shapes.items()}
    group = WeightGroup("127.0.0.1", port, 2, 1)
    times = []
    for version in range(rounds):
        start = time.perf_counter()
        with torch.no_grad():
            for name, tensor in group.receive(plan, version):  # what the engine's update_weights does
                model[name].copy_(tensor)
        times.append(time.perf_counter() - start)
    checksum = float(sum(t.double().sum() for t in model.values()))
    results.put({"receive_and_load_s": times, "checksum": checksum})


def memcpy_seconds(total: int, rounds: int) -> list[float]:
    # Both sides written first: an untouched source maps every page to the kernel's one zero page
    # (cache-resident), which made this "ceiling" 3-5x too fast.
    source, target = torch.full((total,), 7, dtype=torch.uint8), torch.empty(total, dtype=torch.uint8)
    target.copy_(source)
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        target.copy_(source)
        out.append(time.perf_counter() - start)
    return out


def measure_group(model_name: str, rounds: int, bucket_mb: int = 64) -> dict:
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
    group = WeightGroup("127.0.0.1", port, 2, 0)
    send = []
    for version in range(rounds):
        start = time.perf_counter()
        group.send(plan, weights, version)
        send.append(time.perf_counter() - start)
    received = results.get(timeout=600)
    proc.join(timeout=60)
    expected = float(sum(t.double().sum() for t in weights.values()))
    if abs(received["checksum"] - expected) > 1e-6 * max(1.0, abs(expected)):
        raise RuntimeError(f"received weights differ: checksum {received['checksum']} != {expected}")
    update = [max(s, r) for s, r in zip(send, received["receive_and_load_s"])]
    return _figures(weights, total, update, memcpy_seconds(total, rounds),
                    {"buckets": len(plan.buckets), "bucket_mb": bucket_mb,
                     "sender_s_median": statistics.median(send),
                     "receiver_s_median": statistics.median(received["receive_and_load_s"])})


def measure_shm(model_name: str, rounds: int) -> dict:
    """The learner (this process) writes each version into the next of its two shared-memory slots
    (`SharedSlots`); a Ray actor on this node, holding a real engine of the model, adopts views of
    it. Update time: the write and the adoption. The first write also makes the slot files (their
    pages reserved up front), reported apart; the median is the steady state."""
    import ray

    shapes = shapes_of(model_name)
    weights = random_tensors(shapes)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 << 20)  # the weights travel in `SharedSlots`, not the store
    holder = ray.remote(num_cpus=0)(_EngineHolder).remote(model_name)
    ray.get(holder.ready.remote())
    slots = SharedSlots()
    put, adopt = [], []
    first = next(iter(weights.values()))
    for version in range(rounds):
        first.add_(1.0)  # every version differs: the checksum at the end sees the last one landed
        start = time.perf_counter()
        shared = slots.write(weights.items())
        put.append(time.perf_counter() - start)
        start = time.perf_counter()
        adopt.append(ray.get(holder.adopt.remote(Delivery(version, "shm"), shared)))
        call = time.perf_counter() - start
    checksum = ray.get(holder.checksum.remote())
    slots.close()
    expected = float(sum(t.double().sum() for t in weights.values()))
    if abs(checksum - expected) > 1e-6 * max(1.0, abs(expected)):
        raise RuntimeError(f"adopted weights differ: checksum {checksum} != {expected}")
    ray.kill(holder)
    update = [p + a for p, a in zip(put, adopt)]
    return _figures(weights, total, update, memcpy_seconds(total, rounds),
                    {"put_s_median": statistics.median(put), "adopt_s_median": statistics.median(adopt),
                     "first_put_s": put[0], "first_adopt_s": adopt[0], "last_call_s": call})


class _EngineHolder:
    """A generator's engine in its own process: the model of `model_name`, adopting shared views."""

    def __init__(self, model_name: str):
        from asyncrl.engines.torch_engine import TorchEngine

        torch.set_num_threads(1)
        shapes = shapes_of(model_name)
        self.model = torch.nn.Module()
        self.params = {n: torch.nn.Parameter(torch.zeros(s, dtype=d), requires_grad=False) for n, (s, d) in shapes.items()}
        for i, (name, param) in enumerate(self.params.items()):
            self.model.register_parameter(f"p{i}", param)
        self.model.config = type("Config", (), {"max_position_embeddings": 1})()
        self.names = {name: f"p{i}" for i, name in enumerate(self.params)}
        self.engine = TorchEngine(self.model, eos_token_ids=[0])

    def ready(self) -> bool:
        return True

    def adopt(self, delivery: Delivery, shared: SharedVersion) -> float:
        start = time.perf_counter()
        views = shared_views(shared)
        self.engine.adopt_weights(((self.names[n], v) for n, v in views), delivery.weight_version, keepalive=views)
        return time.perf_counter() - start

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.parameters()))


def _cuda_receiver(shapes: dict, rounds: int, inbox, results) -> None:
    """A generator's CUDA parameters in its own process, loaded from the learner's IPC handles."""
    params = {n: torch.zeros(s, dtype=d, device="cuda") for n, (s, d) in shapes.items()}
    times = []
    for _ in range(rounds):
        handles = inbox.get(timeout=600)
        start = time.perf_counter()
        for name, tensor in from_cuda_ipc(handles):
            params[name].copy_(tensor)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        results.put(("loaded", None))  # the learner may release the version now
    results.put(("done", {"load_s": times, "checksum": float(sum(p.double().sum() for p in params.values()))}))


def device_copy_seconds(weights: dict[str, torch.Tensor], rounds: int) -> list[float]:
    """A device-to-device copy of the same tensors (the ceiling on one GPU)."""
    targets = {n: torch.empty_like(t) for n, t in weights.items()}
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for name, tensor in weights.items():
            targets[name].copy_(tensor)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def measure_cuda_ipc(model_name: str, rounds: int) -> dict:
    """The learner's CUDA tensors to another process on the same GPU by IPC handle (the `cuda_ipc`
    path; SGLang's `update_weights_from_tensor` takes the same handles). Update time: making the
    handles, the receiver rebuilding and copying every tensor, and its acknowledgement."""
    shapes = shapes_of(model_name)
    weights = {n: t.cuda() for n, t in random_tensors(shapes).items()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    ctx = mp.get_context("spawn")
    inbox, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_cuda_receiver, args=(shapes, rounds, inbox, results))
    proc.start()
    update = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        inbox.put(to_cuda_ipc(weights.items()))
        kind, _ = results.get(timeout=600)
        update.append(time.perf_counter() - start)
    kind, received = results.get(timeout=600)
    proc.join(timeout=60)
    expected = float(sum(t.double().sum() for t in weights.values()))
    if abs(received["checksum"] - expected) > 1e-6 * max(1.0, abs(expected)):
        raise RuntimeError(f"received weights differ: checksum {received['checksum']} != {expected}")
    return _figures(weights, total, update, device_copy_seconds(weights, rounds),
                    {"receiver_load_s_median": statistics.median(received["load_s"]),
                     "baseline": "device-to-device copy"})


def _figures(weights: dict, total: int, update: list[float], memcpy: list[float], extra: dict) -> dict:
    return {
        "parameters": sum(t.numel() for t in weights.values()), "bytes": total, "rounds": len(update),
        "seconds_per_update_median": statistics.median(update),
        "bytes_per_s_median": total / statistics.median(update),
        "memcpy_s_median": statistics.median(memcpy),
        "memcpy_bytes_per_s_median": total / statistics.median(memcpy),
        "ratio_update_over_memcpy_median": statistics.median(u / m for u, m in zip(update, memcpy)),
        "memcpy_bandwidth_share": statistics.median(memcpy) / statistics.median(update),
        **extra,
    }


def measure(model_name: str, rounds: int, bucket_mb: int = 64) -> dict:
    """The CPU paths for one model, and with a GPU the CUDA IPC path."""
    out = {"shm": measure_shm(model_name, rounds), "group": measure_group(model_name, rounds, bucket_mb)}
    if torch.cuda.is_available():
        out["cuda_ipc"] = measure_cuda_ipc(model_name, rounds)
    return out


def run(quick: bool = False, overrides: list[str] | None = None, step_seconds: dict[str, float] | None = None) -> dict:
    """The models are fixed by name (embedded, 0.5b; tiny with --quick; with a GPU also 1.5b, whose
    CPU paths are measured too). With `engine=sglang_cpu` (.venv-sglang): SGLang's update paths
    beside `shm`, on the embedded model (tiny with --quick)."""
    models = ("tiny", "embedded") if quick else ("embedded", "0.5b", *(("1.5b",) if torch.cuda.is_available() else ()))
    rounds = 3 if quick else 5
    out = {}
    if overrides and compose(overrides).engine.name == "sglang":
        from asyncrl.bench.sglang_bench import update_speed

        for name, model in ((("tiny", ["model=tiny"]),) if quick else (("embedded", []),)):
            out[name] = {"shm": measure_shm(name, rounds), **update_speed(compose([*overrides, *model]), rounds, memcpy_seconds)}
            print(name, out[name], flush=True)
        return out
    for name in models:
        out[name] = measure(name, rounds)
        step = (step_seconds or {}).get(name)
        if step:
            for path in out[name].values():
                path["learner_step_s"] = step
                path["fraction_of_step"] = path["seconds_per_update_median"] / step
        print(name, out[name], flush=True)
    from asyncrl.bench import lora_broadcast  # full against LoRA and delta versions (`asyncrl bench lora`)

    out["updates"] = lora_broadcast.run(quick)
    return out


def report(result: dict) -> str:
    """The copy columns: a memory copy of the same bytes (a device-to-device copy for cuda_ipc)."""
    lines = ["| model | path | parameters | bytes | s / update | GB/s | copy s | copy GB/s | share of copy bandwidth |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, paths in result.items():
        if name == "updates":
            continue
        for path, r in paths.items():
            if not isinstance(r, dict):
                continue
            lines.append(f"| {name} | {path} | {r['parameters'] / 1e6:.1f}M | {r['bytes'] / 1e6:.0f} MB | "
                         f"{r['seconds_per_update_median']:.3f} | {r['bytes_per_s_median'] / 1e9:.2f} | "
                         f"{r['memcpy_s_median']:.3f} | {r['memcpy_bytes_per_s_median'] / 1e9:.2f} | "
                         f"{100 * r['memcpy_bandwidth_share']:.0f}% |")
    if "updates" in result:
        from asyncrl.bench.lora_broadcast import report_lines

        lines += ["", *report_lines(result["updates"])]
    return "\n".join(lines)
