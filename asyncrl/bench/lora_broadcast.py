"""What a weight update costs as a LoRA adapter or as a delta, against the whole version: the rows
`asyncrl bench broadcast` adds to its paths. Each variant goes through the learner's own sender
(`asyncrl.weights.transport.WeightSender`) and a generator process's own load (`asyncrl.weights.transport.load`
into a `TorchEngine` holding the model), over shared memory (`shm`, the learner's node) and the
distributed group (`group`, gloo over TCP here: another node's path):

* `full`: every weight, as the learner holds them (float32); the engine computes in bfloat16.
* `lora8`, `lora64`: the adapter of rank 8 / 64 on every linear layer (A and B in float32); the
  engine merges it into its unmerged base (`asyncrl.weights.lora.AdapterMerger`).
* `delta`: every weight moved by an Adam-sized step (each by +-lr, lr 1e-5: the demo's) and sent as
  what changed in the engine's bfloat16 since the last version (`asyncrl.weights.delta`).

Update time: the sender's staging and sending, and the generator's load, until it answers. Also
(`engine_modes`): the embedded engine with a rank-32 adapter merged into its weights against LoRA
computed in its forward (each adapted linear layer `base(x) + s * B(A(x))`), decode speed and the
cost of taking a version.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.multiprocessing as mp

from asyncrl.weights import transport
from asyncrl.weights.delta import DeltaTracker
from asyncrl.weights.sync import AdapterSpec, WeightGroup, free_port, plan_buckets

ENGINE_DTYPE = torch.bfloat16
LR = 1e-5


def build_model(model_name: str, layers: int | None, dtype=ENGINE_DTYPE, meta: bool = False):
    """The model's architecture with random weights (the embedded one: its real weights), with
    `layers` decoder layers (None: all); `meta`: shapes only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.bench.common import HALF_B, ONE_HALF_B

    if model_name in ("embedded", "tiny"):
        from asyncrl.config import compose
        from asyncrl.models.loading import load_policy

        model, _ = load_policy(compose(["model=tiny"] if model_name == "tiny" else []).model)
        return model.to(dtype)
    spec = dict({"0.5b": HALF_B, "1.5b": ONE_HALF_B}[model_name])
    if layers:
        spec["num_hidden_layers"] = layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), torch_dtype=dtype)
    if meta:
        return model
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def learner_tensors(model, variant: str) -> dict[str, torch.Tensor]:
    """What the learner holds of the variant: float32 weights, or a LoRA adapter of the rank named."""
    from asyncrl.weights.lora import adaptable_modules

    if not variant.startswith("lora"):
        g = torch.Generator().manual_seed(3)
        return {n: (p.detach().float().clone() if p.device.type == "cpu" else torch.randn(p.shape, generator=g) * 0.02)
                for n, p in model.named_parameters()}
    rank, g = int(variant[4:]), torch.Generator().manual_seed(1)
    modules = dict(model.named_modules())
    out = {}
    for name in adaptable_modules(model):
        linear = modules[name]
        out[name + ".lora_A"] = torch.randn((rank, linear.in_features), generator=g) * 0.01
        out[name + ".lora_B"] = torch.randn((linear.out_features, rank), generator=g) * 0.01
    return out


def _generator(model_name: str, layers, port: int, inbox, outbox) -> None:
    """A generator's side: its engine, its group with the learner, each delivery loaded and timed."""
    from asyncrl.engines.torch_engine import TorchEngine

    torch.set_num_threads(1)
    engine = TorchEngine(build_model(model_name, layers), eos_token_ids=[0])
    group = WeightGroup("127.0.0.1", port, 2, 1, timeout_s=600, join_timeout_s=600)
    outbox.put("ready")
    while (item := inbox.get(timeout=1800)) is not None:
        delivery, payload = item
        start = time.perf_counter()
        transport.load(engine, delivery, payload, group if delivery.path == "group" else None)
        outbox.put(time.perf_counter() - start)


def measure(model_name: str, variants: list[str], rounds: int, layers: int | None = None) -> dict:
    """Every variant over both paths to one generator process; figures per (variant, path)."""
    # The learner's side: float32 (the embedded model's own weights; shapes for the others).
    model = build_model(model_name, layers, dtype=torch.float32, meta=model_name not in ("embedded", "tiny"))
    ctx = mp.get_context("spawn")
    inbox, outbox, port = ctx.Queue(), ctx.Queue(), free_port()
    proc = ctx.Process(target=_generator, args=(model_name, layers, port, inbox, outbox))
    proc.start()
    group = WeightGroup("127.0.0.1", port, 2, 0, timeout_s=600, join_timeout_s=600)
    outbox.get(timeout=1800)
    out = {}
    try:
        for variant in variants:
            weights = learner_tensors(model, variant)
            for path in ("shm", "group"):
                out[f"{variant}_{path}"] = _rounds(weights, variant, path, rounds, group, inbox, outbox,
                                                   model.config.num_hidden_layers)
                print(model_name, variant, path, out[f"{variant}_{path}"], flush=True)
            del weights
    finally:
        inbox.put(None)
        proc.join(timeout=120)
    return out


def _rounds(weights: dict, variant: str, path: str, rounds: int, group, inbox, outbox, layers: int) -> dict:
    adapter = AdapterSpec(int(variant[4:]), 2.0 * int(variant[4:])) if variant.startswith("lora") else None
    delta = DeltaTracker(ENGINE_DTYPE) if variant == "delta" else None
    sender = transport.WeightSender(plan_buckets(weights.items(), 64 << 20), adapter, delta)
    sender.groups["g"] = group
    g = torch.Generator().manual_seed(2)
    seconds, loads, sent, changed = [], [], [], []
    try:
        for version in range(rounds + 1):  # round 0: the first version (files made; a delta's whole version)
            with torch.no_grad():
                for t in weights.values():  # every version differs (a delta: an Adam-sized step)
                    t.add_(LR * torch.randn(t.shape, generator=g).sign())
            start = time.perf_counter()
            staged = sender.stage(version, weights.items(), weights if path == "group" else None, {path})
            delivery, payload = sender.delivery(staged, path)
            inbox.put((delivery, payload if path == "shm" else None))
            if path == "group":
                sender.send_group(staged, "g")
            load_s = outbox.get(timeout=1800)
            if version:
                seconds.append(time.perf_counter() - start)
                loads.append(load_s)
                sent.append(sender.bytes_of(staged))
                if staged.delta is not None:
                    changed.append(staged.delta["elements_changed"] / staged.delta["elements"])
    finally:
        sender.groups.pop("g")
        sender.slots.close()
    out = {"bytes": statistics.median(sent), "seconds_per_update_median": statistics.median(seconds),
           "generator_load_s_median": statistics.median(loads), "rounds": rounds, "layers": layers,
           "parameters": sum(t.numel() for t in weights.values())}
    if changed:
        out["changed_fraction_median"] = statistics.median(changed)
    return out


class LoraForward(torch.nn.Module):
    """A linear layer computing LoRA in its forward: `base(x) + scaling * B(A(x))`."""

    def __init__(self, base: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor, scaling: float):
        super().__init__()
        self.base, self.scaling = base, scaling
        self.a = torch.nn.Parameter(a.to(base.weight.dtype), requires_grad=False)
        self.b = torch.nn.Parameter(b.to(base.weight.dtype), requires_grad=False)

    def forward(self, x):
        return self.base(x) + self.scaling * torch.nn.functional.linear(torch.nn.functional.linear(x, self.a), self.b)


def engine_modes(rank: int = 32, batch: int = 16, tokens: int = 32, rounds: int = 3) -> dict:
    """The embedded engine (bfloat16) with an adapter merged into its weights against LoRA in its
    forward: seconds to take a version, and decode seconds of a window (`batch` sequences of
    `tokens` new tokens after a 40-token prompt), paired rounds."""
    from asyncrl.config import compose
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.generation import build_engine, sequence_input
    from asyncrl.weights.lora import adaptable_modules

    torch.set_num_threads(1)
    config = compose([])
    merged, _ = build_engine(config.model, dtype=ENGINE_DTYPE)
    forward, _ = build_engine(config.model, dtype=ENGINE_DTYPE)
    adapter = learner_tensors(merged.model, f"lora{rank}")
    spec = AdapterSpec(rank, 2.0 * rank)
    modules = dict(forward.model.named_modules())
    for name in adaptable_modules(forward.model):
        parent, child = name.rsplit(".", 1)
        setattr(modules[parent], child, LoraForward(modules[name], adapter[name + ".lora_A"],
                                                    adapter[name + ".lora_B"], spec.scaling))
    wrapped = {n: m for n, m in forward.model.named_modules() if isinstance(m, LoraForward)}
    prompts = [list(range(100 + i, 140 + i)) for i in range(batch)]
    params = SamplingParams.of(config.sampling)
    times: dict[str, list[float]] = {"merge_load_s": [], "forward_load_s": [], "merged_window_s": [],
                                     "forward_window_s": []}
    for round_ in range(rounds + 1):
        start = time.perf_counter()
        merged.load_adapter(adapter.items(), spec, round_ + 1)
        load_merge = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():  # LoRA in the forward: a version is its A and B copied in
            for name, module in wrapped.items():
                module.a.copy_(adapter[name + ".lora_A"])
                module.b.copy_(adapter[name + ".lora_B"])
        load_forward = time.perf_counter() - start
        windows = {}
        for label, engine in (("merged", merged), ("forward", forward)):
            start = time.perf_counter()
            engine.generate_window_sync([sequence_input(p, i, tokens) for i, p in enumerate(prompts)], tokens, params)
            windows[label] = time.perf_counter() - start
        if round_:
            for key, value in (("merge_load_s", load_merge), ("forward_load_s", load_forward),
                               ("merged_window_s", windows["merged"]), ("forward_window_s", windows["forward"])):
                times[key].append(value)
    return {"rank": rank, "batch": batch, "tokens": tokens, "rounds": rounds,
            **{key: statistics.median(v) for key, v in times.items()}}


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    """`asyncrl bench lora` (and the LoRA rows of `asyncrl bench broadcast`): the tiny model with
    --quick; else the embedded model and Qwen2.5-1.5B's shapes (random; with all 28 layers when the
    machine has 16 GB available, else 14: the merge and the adapter scale with the layers)."""
    import psutil

    rounds = 2 if quick else 4
    if quick:
        return {"tiny": measure("tiny", ["full", "lora8", "delta"], rounds)}
    layers = 28 if psutil.virtual_memory().available > 16e9 else 14
    return {"embedded": measure("embedded", ["full", "lora8", "lora64", "delta"], rounds),
            "1.5b": measure("1.5b", ["lora8", "lora64"], rounds, layers),
            "engine_modes": engine_modes()}


def report(result: dict) -> str:
    return "\n".join(report_lines(result))


def report_lines(result: dict) -> list[str]:
    lines = ["| model | variant | path | bytes / update | s / update | generator load s | changed |",
             "|---|---|---|---|---|---|---|"]
    for model, rows in result.items():
        if model == "engine_modes":
            continue
        for key, r in rows.items():
            variant, path = key.rsplit("_", 1)
            changed = f"{100 * r['changed_fraction_median']:.1f}%" if "changed_fraction_median" in r else ""
            lines.append(f"| {model} ({r['layers']} layers) | {variant} | {path} | {r['bytes'] / 1e6:.1f} MB | "
                         f"{r['seconds_per_update_median']:.3f} | {r['generator_load_s_median']:.3f} | {changed} |")
    m = result.get("engine_modes")
    if m:
        lines.append(f"embedded engine, rank {m['rank']}: take a version: merge {m['merge_load_s']:.3f} s, "
                     f"forward {m['forward_load_s']:.4f} s; a window of {m['batch']} x {m['tokens']} tokens: merged "
                     f"{m['merged_window_s']:.2f} s, LoRA in the forward {m['forward_window_s']:.2f} s")
    return lines
