"""A GPU check for a bare machine: the embedded engine, the policy learner, the weight update and
FSDP2 on whatever device torch sees (CUDA if present, else the CPU), without Ray, on the embedded
model's shapes (SmolLM2-135M) with random weights: no model file travels.

The machine this is for has torch (CUDA), transformers, safetensors, numpy and pyarrow, reaches no
package registry and takes at most 64 MiB with each command. `make gpu-wheels` puts what else this
imports (msgspec, omegaconf, hydra-core, antlr4: `load_tests/gpu_wheels.py`) into `.whl/`;
docs/gpu.md gives the one command that installs them there and runs this. Nothing here imports Ray,
Ray's wheel alone being over the limit (tests/test_gpu_check.py runs this where only those packages
can be imported).

    python load_tests/gpu_check.py [--tiny] [--quick] [--json PATH]

It prints one table, each row a figure beside what it is measured against:

* the embedded engine's tokens/s (`TorchEngine`, the generators' engine) at batch 1, 16, 64 and 256
  against transformers' `generate` on the same model, in the engine's own dtype (`engine.dtype=auto`:
  bf16 on a GPU) and in fp32;
* the policy learner's step (`PolicyRank.step`: log-probs, the run's loss, backward, clip, AdamW) in
  fp32 and in bf16 autocast, with the learners' fused AdamW; and AdamW's step alone, fused against
  torch's default;
* a weight update between two processes by the path a generator on the learner's device takes
  (`asyncrl.weights.transport`: CUDA IPC on a GPU, shared memory on a CPU) into a real engine, against a
  device-to-device copy (on a CPU, a memory copy) of the same bytes;
* the engine's log-probs against the learner's on the same sampled tokens, in bf16 (and in fp32);
* an FSDP2 step at world size 1 (`asyncrl.weights.sharding`) against the plain step from the same weights.

Each check runs on its own: one that fails is a row saying why, and the script then exits 1.
Sized to finish in well under 8 minutes on one H100; `--quick` (with `--tiny`: the tiny model's
shapes) is CI's size, seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # asyncrl from this tree: on the bare machine it is not installed

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from asyncrl.bench.broadcast import device_copy_seconds, memcpy_seconds  # noqa: E402
from asyncrl.bench.learner import synthetic_batch  # noqa: E402
from asyncrl.config import compose  # noqa: E402
from asyncrl.config.fields import replaced  # noqa: E402
from asyncrl.engines.base import SamplingParams  # noqa: E402
from asyncrl.engines.generation import sequence_input  # noqa: E402
from asyncrl.engines.torch_engine import TorchEngine, engine_precision  # noqa: E402
from asyncrl.learning.policy import proximal_logprobs  # noqa: E402
from asyncrl.learning.rank import PolicyRank, learner_precision, policy_objective  # noqa: E402
from asyncrl.learning.scoring import PolicyForward  # noqa: E402
from asyncrl.learning.tensors import adamw, collate  # noqa: E402
from asyncrl.messages.structs import FinishReason, Segment, TrainingRow, float32_array, int32_array  # noqa: E402
from asyncrl.models.loading import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from asyncrl.weights import sharding  # noqa: E402
from asyncrl.weights.sync import free_port, plan_buckets  # noqa: E402
from asyncrl.weights.transport import WeightSender, load  # noqa: E402

# SmolLM2-135M-Instruct's architecture, as transformers reads it from the embedded GGUF file
# (`model.source=gguf`; tests/test_gpu_check.py holds these to that file's config).
EMBEDDED_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
                       hidden_act="silu", tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
BATCHES = (1, 16, 64, 256)
NEVER = [-1]  # an EOS id no token has: every row of the speed check runs its full length
FIRST_ID = 3  # random prompts avoid the special ids below it (pad, EOS, BOS of both models)


@dataclass(frozen=True)
class Sizes:
    new_tokens: int  # engine: tokens each row generates
    prompt_tokens: int  # engine: random prompt tokens a row
    rounds: int  # timed rounds after a warm-up round, each variant once a round
    learner_rows: int
    learner_prompt: int
    learner_response: int
    logprob_rows: int
    logprob_tokens: int
    updates: int  # weight updates timed (after a first one)
    warmup: bool  # a first, untimed round of each timed variant


FULL = Sizes(new_tokens=64, prompt_tokens=64, rounds=3, learner_rows=64, learner_prompt=64, learner_response=448,
             logprob_rows=64, logprob_tokens=128, updates=5, warmup=True)
# CI's: every path once, in seconds; its figures say nothing of speed.
QUICK = Sizes(new_tokens=8, prompt_tokens=8, rounds=1, learner_rows=4, learner_prompt=8, learner_response=8,
              logprob_rows=4, logprob_tokens=8, updates=2, warmup=False)


@dataclass
class Row:
    check: str
    measured: str
    against: str = ""
    ratio: str = ""
    notes: str = ""


def random_model(shapes: dict, device: str, seed: int) -> LlamaForCausalLM:
    """A Llama of `shapes` with random weights (seeded: the same seed gives the same weights), fp32."""
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**shapes)).float().eval()


def tiny_shapes(config) -> dict:
    """The tiny model's architecture, from the project's own builder (`model=tiny`)."""
    built = build_tiny_model(config.model, len(build_tiny_tokenizer())).config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id")
    return {key: getattr(built, key) for key in keys}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def paired(calls: dict, rounds: int, device: str, warmup: bool = True) -> dict[object, list[float]]:
    """Seconds of each call, each once a round (a first round warms up: allocator, kernels)."""
    seconds: dict[object, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds + int(warmup)):
        for name, call in calls.items():
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            if round_ or not warmup:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def ratio_median(slow: list[float], fast: list[float]) -> float:
    """The median over rounds of slow / fast (paired: each round's pair saw the same machine)."""
    return statistics.median(s / f for s, f in zip(slow, fast))


class Check:
    """What every check shares: the run's config (`compose`), the model's shapes, the device, the sizes."""

    def __init__(self, tiny: bool, quick: bool, device: str):
        self.device, self.sizes = device, QUICK if quick else FULL
        groups = ["model=tiny", "task=tiny"] if tiny else []
        self.config = compose(groups + [f"engine.device={device}", f"policy.compute.device={device}"])
        self.shapes = tiny_shapes(self.config) if tiny else EMBEDDED_SHAPES
        shapes = self.shapes
        self.vocab, self.pad, self.eos = shapes["vocab_size"], shapes["pad_token_id"], shapes["eos_token_id"]

    def model(self, seed: int = 0) -> LlamaForCausalLM:
        return random_model(self.shapes, self.device, seed)

    def objective(self, lm, precision: str):
        config = self.config
        return replaced(policy_objective(config.algorithm, config.policy, config.engine, config.sampling, lm),
                        {"policy.compute.precision": precision})

    def prompts(self, rows: int, tokens: int, seed: int = 0) -> torch.Tensor:
        return torch.randint(FIRST_ID, self.vocab, (rows, tokens), generator=torch.Generator().manual_seed(seed))

    def batch(self) -> list[TrainingRow]:
        s = self.sizes
        return synthetic_batch(s.learner_rows, s.learner_prompt, s.learner_response, self.vocab)


# --- the checks ------------------------------------------------------------------------------------


def hf_generate(model, input_ids: torch.Tensor, new_tokens: int, pad: int) -> None:
    """transformers' `generate` as a user samples: every row exactly `new_tokens` (EOS held back)."""
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=pad)
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate made {out.shape[1] - input_ids.shape[1]} tokens a row, not {new_tokens}")


def check_engine(ctx: Check) -> tuple[list[Row], dict]:
    s, device = ctx.sizes, ctx.device
    model = ctx.model()
    dtype = engine_precision("auto", device, model, 64).dtype
    engines = {dtype: TorchEngine(model, NEVER, ctx.pad, dtype=dtype),
               torch.float32: TorchEngine(model, NEVER, ctx.pad)}  # one entry where the engine's dtype is fp32
    params = SamplingParams(temperature=1.0)
    prompts = ctx.prompts(max(BATCHES), s.prompt_tokens)
    rows, figures = [], {}
    for batch in BATCHES:
        sequences = [sequence_input(p.tolist(), i, s.new_tokens) for i, p in enumerate(prompts[:batch])]
        input_ids = prompts[:batch].to(device)
        calls: dict[tuple[str, torch.dtype], Callable] = {}
        for dt, engine in engines.items():  # generate runs on the engine's own copy of the weights
            calls[("engine", dt)] = lambda e=engine: e.generate_window_sync(sequences, s.new_tokens, params)
            calls[("generate", dt)] = lambda m=engine.model: hf_generate(m, input_ids, s.new_tokens, ctx.pad)
        seconds = paired(calls, s.rounds, device, s.warmup)
        for dt in engines:
            name = str(dt).removeprefix("torch.")
            ours, theirs = seconds[("engine", dt)], seconds[("generate", dt)]
            tokens = batch * s.new_tokens
            rate, their_rate = tokens / statistics.median(ours), tokens / statistics.median(theirs)
            figures[f"batch_{batch}_{name}"] = {"engine_tokens_per_s": rate, "generate_tokens_per_s": their_rate,
                                                "engine_over_generate": ratio_median(theirs, ours)}
            rows.append(Row(f"engine tokens/s, batch {batch}, {name}", f"{rate:,.0f}", f"generate {their_rate:,.0f}",
                            f"{ratio_median(theirs, ours):.2f}x",
                            f"{s.new_tokens} new tokens a row after {s.prompt_tokens}; median of {s.rounds}"))
    return rows, figures


def check_learner(ctx: Check) -> tuple[list[Row], dict]:
    s, device = ctx.sizes, ctx.device
    batch = ctx.batch()
    ranks = {}
    for precision in ("fp32", "bf16"):
        lm = ctx.model()
        ranks[precision] = PolicyRank(lm, ctx.objective(lm, precision))
    fused = {p: bool(r.optimizer.defaults.get("fused")) for p, r in ranks.items()}
    if not all(fused.values()):
        raise RuntimeError(f"the learner's AdamW is not fused on {device}: {fused}")
    seconds = paired({p: (lambda r=r: r.step(batch)) for p, r in ranks.items()}, s.rounds, device, s.warmup)
    del ranks
    tokens = s.learner_rows * s.learner_response
    fp32, bf16 = statistics.median(seconds["fp32"]), statistics.median(seconds["bf16"])
    policy = ctx.config.policy
    shape = (f"{s.learner_rows} rows of {s.learner_prompt} + {s.learner_response} tokens, "
             f"{policy.ppo_epochs * policy.mini_batches} AdamW updates a step ({ctx.config.algorithm.name})")
    rows = [Row("learner step fp32, fused AdamW", f"{fp32:.3f} s", "", "",
                f"{tokens / fp32:,.0f} trained tokens/s; {shape}; median of {s.rounds}"),
            Row("learner step bf16 autocast, fused AdamW", f"{bf16:.3f} s", f"fp32 {fp32:.3f} s",
                f"{ratio_median(seconds['fp32'], seconds['bf16']):.2f}x", f"{tokens / bf16:,.0f} trained tokens/s")]
    adam_rows, adam = adamw_step(ctx)
    figures = {"fp32_s": fp32, "bf16_s": bf16, "trained_tokens": tokens, **adam}
    return rows + adam_rows, figures


def adamw_step(ctx: Check) -> tuple[list[Row], dict]:
    """AdamW's step alone over the model's parameters (random gradients): the learners' fused one
    (`asyncrl.learning.tensors.adamw`) against torch's default implementation."""
    parameters = list(ctx.model().parameters())
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizers = {"fused": adamw(parameters, 1e-6, 0.0), "default": torch.optim.AdamW(parameters, lr=1e-6)}
    rounds = max(5, ctx.sizes.rounds)
    seconds = paired({name: o.step for name, o in optimizers.items()}, rounds, ctx.device, ctx.sizes.warmup)
    fused, default = statistics.median(seconds["fused"]), statistics.median(seconds["default"])
    count = sum(p.numel() for p in parameters)
    return ([Row("AdamW step alone, fused", f"{fused * 1e3:.2f} ms", f"torch's default {default * 1e3:.2f} ms",
                 f"{ratio_median(seconds['default'], seconds['fused']):.2f}x",
                 f"{count / 1e6:.1f}M fp32 parameters; median of {rounds}")],
            {"adamw_fused_s": fused, "adamw_default_s": default})


def _receiver(shapes: dict, device: str, inbox, outbox) -> None:
    """A generator's side in a second process: a real engine of the model (its own random weights,
    in the dtype a generator runs) loading each delivery by the generator's own code (`transport.load`)."""
    try:
        model = random_model(shapes, device, seed=1)
        engine = TorchEngine(model, [shapes["eos_token_id"]], shapes["pad_token_id"],
                             dtype=engine_precision("auto", device, model, 64).dtype)
        outbox.put(("ready", str(next(engine.model.parameters()).dtype)))
        while (item := inbox.get()) is not None:
            delivery, payload = item
            synchronize(device)
            start = time.perf_counter()
            load(engine, delivery, payload, None)
            synchronize(device)
            outbox.put(("loaded", time.perf_counter() - start))
        sums = {n: float(p.detach().double().sum()) for n, p in engine.model.named_parameters()}
        outbox.put(("done", (engine.weight_version, sums)))
    except Exception as exc:  # the learner's side waits on the outbox: it gets the error instead
        outbox.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def check_weight_update(ctx: Check) -> tuple[list[Row], dict]:
    """The learner's weights (fp32) to a generator's engine in another process, by the path of a
    generator on the learner's device: `cuda_ipc` on a GPU (the handles of a copy taken between two
    steps), `shm` on a CPU (the learner writes a shared-memory slot, the engine views it). An update:
    staging, the delivery, the engine's load, its acknowledgement; the copy the learner takes for
    `cuda_ipc` (`PolicyRank.snapshot`) happens before, as between two steps, and is not counted."""
    s, device = ctx.sizes, ctx.device
    path = "cuda_ipc" if device == "cuda" else "shm"
    lm = ctx.model()
    named = dict(lm.named_parameters())
    total = sum(t.numel() * t.element_size() for t in named.values())
    sender = WeightSender(plan_buckets(named.items(), ctx.config.policy.broadcast_bucket_mb << 20))
    spawn = multiprocessing.get_context("spawn")
    inbox, outbox = spawn.Queue(), spawn.Queue()
    process = spawn.Process(target=_receiver, args=(ctx.shapes, device, inbox, outbox), daemon=True)
    process.start()
    finished = False
    try:
        engine_dtype_name = _expect(outbox, "ready", process)
        seconds, loads = [], []
        for version in range(1, s.updates + 2):
            with torch.no_grad():
                next(iter(named.values())).add_(1.0)  # every version differs: the checksums see the last land
            whole = {n: t.detach().clone() for n, t in named.items()} if path == "cuda_ipc" else None
            synchronize(device)
            start = time.perf_counter()
            staged = sender.stage(version, named.items(), whole, paths={path})
            inbox.put(sender.delivery(staged, path))
            loads.append(_expect(outbox, "loaded", process))
            seconds.append(time.perf_counter() - start)
        inbox.put(None)
        version, sums = _expect(outbox, "done", process)
        finished = True
    finally:
        process.join(timeout=30 if finished else 0)  # after an error it may still wait for a delivery
        if process.is_alive():
            process.kill()
            process.join()
        sender.slots.close()
    dtype = getattr(torch, engine_dtype_name.removeprefix("torch."))
    expected = {n: float(t.detach().to(dtype).double().sum()) for n, t in named.items()}
    wrong = [n for n in expected if abs(sums[n] - expected[n]) > 1e-3 * max(1.0, abs(expected[n]))]
    if version != s.updates + 1 or wrong:
        raise RuntimeError(f"the engine holds version {version} and differs from the learner's in {wrong[:3]}")
    steady, first = seconds[1:], seconds[0]
    copies = (device_copy_seconds(named, s.updates) if device == "cuda" else memcpy_seconds(total, s.updates))
    update, copy = statistics.median(steady), statistics.median(copies)
    baseline = "device-to-device copy" if device == "cuda" else "memory copy"
    how = ("CUDA IPC handles" if path == "cuda_ipc"
           else "on CPU: the shared-memory path (shm), not CUDA IPC")
    return ([Row(f"weight update {path}, 2 processes", f"{update * 1e3:.3g} ms ({total / update / 1e9:.3g} GB/s)",
                 f"{baseline} {copy * 1e3:.3g} ms ({total / copy / 1e9:.3g} GB/s)", f"{copy / update:.0%} of the copy",
                 f"{how}; {total / 1e6:.3g} MB fp32 into an engine in {engine_dtype_name.removeprefix('torch.')}; "
                 f"engine's load {statistics.median(loads[1:]) * 1e3:.3g} ms; first update {first * 1e3:.3g} ms; "
                 f"median of {s.updates}")],
            {"path": path, "bytes": total, "update_s": update, "copy_s": copy, "first_update_s": first,
             "engine_load_s": statistics.median(loads[1:])})


def _expect(outbox, kind: str, process, timeout_s: float = 300.0):
    """The receiving process's next message, which must be `kind`; its error, or its death, raised here."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got, value = outbox.get(timeout=1.0)
            break
        except queue.Empty:
            if not process.is_alive():
                raise RuntimeError(f"the receiving process died (exit code {process.exitcode})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the receiving process sent nothing in {timeout_s:.0f} s") from None
    if got == "error":
        raise RuntimeError(f"the receiving process failed: {value}")
    if got != kind:
        raise RuntimeError(f"the receiving process said {got!r}, expected {kind!r}")
    return value


def sampled_batch(ctx: Check, engine: TorchEngine, params: SamplingParams) -> list[TrainingRow]:
    """Responses the engine samples from random prompts, as the learner receives them."""
    s = ctx.sizes
    prompts = ctx.prompts(s.logprob_rows, s.prompt_tokens, seed=1).numpy()
    outs = engine.generate_window_sync([sequence_input(p, 100 + i, s.logprob_tokens) for i, p in enumerate(prompts)],
                                       s.logprob_tokens, params)
    samples = []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        n = len(out.token_ids)
        segment = Segment(prompt_id=f"p{i}", sample_idx=0, window=0, group_id=f"p{i}", group_size=1,
                          prompt_token_ids=int32_array(prompt), prior_response_ids=int32_array([]),
                          prior_versions=int32_array([]), new_token_ids=out.token_ids, new_logprobs=out.logprobs,
                          new_versions=int32_array([0] * n), finished=out.finish_reason is not FinishReason.WINDOW,
                          seed=100 + i, finish_reason=out.finish_reason, data_source="gpu_check",
                          new_scored=out.scored)
        samples.append(TrainingRow(segment=segment, score=0.0, correct=False, advantages=float32_array(np.ones(n))))
    return samples


def check_logprobs(ctx: Check) -> tuple[list[Row], dict]:
    """The behaviour log-probs the engine records against the learner's of the same tokens (the
    learner's fp32 master weights, bf16 autocast), at the run's sampling settings. The weights are
    random: a flatter distribution than a trained model's."""
    lm = ctx.model()
    params = SamplingParams.of(ctx.config.sampling)
    rows, figures = [], {}
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        engine = TorchEngine(lm, [ctx.eos], ctx.pad, dtype=dtype)
        samples = sampled_batch(ctx, engine, params)
        objective = ctx.objective(lm, precision)
        collated = collate(sorted(samples, key=lambda x: len(x.segment.new_token_ids)), ctx.pad).to(ctx.device)
        trained = collated.response_mask > 0
        with torch.no_grad():
            learner = proximal_logprobs(PolicyForward(lm), collated, objective.policy, objective.sampling)[trained]
        gap = (learner - collated.old_logprobs[trained]).abs()
        figures[precision] = {"max": float(gap.max()), "mean": float(gap.mean()), "tokens": int(trained.sum())}
        label = "bf16 (engine bf16 weights, learner bf16 autocast)" if precision == "bf16" else "fp32"
        rows.append(Row(f"log-probs engine vs learner, {label}", f"max {gap.max():.2e}, mean {gap.mean():.2e}", "", "",
                        f"absolute difference over {int(trained.sum())} sampled tokens, temperature "
                        f"{ctx.config.sampling.temperature}; random weights"))
    return rows, figures


def check_fsdp(ctx: Check) -> tuple[list[Row], dict]:
    """One learner rank sharded by FSDP2 (`asyncrl.weights.sharding`, the default group: NCCL on a GPU, gloo
    on a CPU) against the plain rank, both from the same weights on the same batch: the first
    step's loss and gradient norm must agree (the updated weights' largest difference is reported:
    Adam's first step moves a weight by about the learning rate whatever the size of its gradient, so
    a gradient near zero that rounds to the other sign on a GPU moves it the other way); then their
    step times."""
    s, device = ctx.sizes, ctx.device
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    port = free_port()
    store = sharding.rendezvous_store("127.0.0.1", port)  # noqa: F841 (held while the group lives)
    parallel = sharding.join("127.0.0.1", port, 1, 0, backend, timeout_s=300)
    try:
        batch = ctx.batch()
        lms = {"plain": ctx.model(), "fsdp2": ctx.model()}
        precision = learner_precision("auto", lms["plain"], device, "gpu check").name
        ranks = {name: PolicyRank(lm, ctx.objective(lm, precision), parallel=parallel if name == "fsdp2" else None)
                 for name, lm in lms.items()}
        first = {name: rank.step(batch) for name, rank in ranks.items()}
        weights = {name: rank.snapshot() for name, rank in ranks.items()}
        drift = max(float((weights["fsdp2"][n].cpu() - t.cpu()).abs().max()) for n, t in weights["plain"].items())
        del weights
        norm = first["plain"]["grad_norm"]
        norm_gap = abs(first["fsdp2"]["grad_norm"] - norm) / max(norm, 1e-12)
        loss_gap = abs(first["fsdp2"]["loss"] - first["plain"]["loss"])
        seconds = paired({name: (lambda r=r: r.step(batch)) for name, r in ranks.items()}, s.rounds, device,
                         warmup=False)
    finally:
        sharding.leave()
    loss = abs(first["plain"]["loss"])
    if norm_gap > 1e-3 or loss_gap > 1e-3 * max(loss, 1e-3):
        raise RuntimeError(f"FSDP2's step differs from the plain one: gradient norm {norm_gap:.2e} relative, "
                           f"loss {loss_gap:.2e} (of {loss:.3g})")
    lr = ctx.config.policy.optimizer.lr
    fsdp, plain = statistics.median(seconds["fsdp2"]), statistics.median(seconds["plain"])
    return ([Row(f"FSDP2 step, world size 1, {precision}", f"{fsdp:.3f} s", f"plain step {plain:.3f} s",
                 f"{ratio_median(seconds['plain'], seconds['fsdp2']):.2f}x",
                 f"{backend}; first step vs plain: loss {loss_gap:.1e}, grad norm {norm_gap:.1e} relative, "
                 f"updated weights {drift:.1e} at most (lr {lr:g}); AdamW default (DTensors); median of {s.rounds}")],
            {"fsdp2_s": fsdp, "plain_s": plain, "grad_norm_relative_gap": norm_gap, "loss_gap": loss_gap,
             "weights_max_gap": drift})


CHECKS: dict[str, Callable[[Check], tuple[list[Row], dict]]] = {
    "engine": check_engine, "learner": check_learner, "weight_update": check_weight_update,
    "logprobs": check_logprobs, "fsdp2": check_fsdp,
}


# --- the table -------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"CPU: {line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"CPU: {platform.processor() or platform.machine()}"


def header(ctx: Check, tiny: bool, quick: bool) -> str:
    shapes = ctx.shapes
    count = sum(p.numel() for p in random_model(shapes, "meta", 0).parameters())
    model = "the tiny model's shapes" if tiny else "the embedded model's shapes (SmolLM2-135M)"
    return (f"GPU check on {device_name(ctx.device)}; torch {torch.__version__}, "
            f"transformers {transformers.__version__}, Python {platform.python_version()}; {model}: "
            f"{shapes['num_hidden_layers']} layers, hidden {shapes['hidden_size']}, "
            f"{shapes['num_attention_heads']} heads / {shapes['num_key_value_heads']} KV, "
            f"vocabulary {shapes['vocab_size']}, {count / 1e6:.1f}M parameters, random weights; "
            f"{'quick' if quick else 'full'} sizes")


def table(rows: list[Row]) -> str:
    lines = ["| check | measured | against | ratio | notes |", "|---|---|---|---|---|"]
    lines += [f"| {r.check} | {r.measured} | {r.against} | {r.ratio} | {r.notes} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny model's shapes (CI) instead of the embedded model's")
    parser.add_argument("--quick", action="store_true", help="small batches and one round (CI)")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = Check(args.tiny, args.quick, device)
    setup = header(ctx, args.tiny, args.quick)
    print(setup, flush=True)
    rows, figures, failed, spent = [], {}, [], {}
    start = time.perf_counter()
    for name in args.only or CHECKS:
        began = time.perf_counter()
        try:
            new_rows, figures[name] = CHECKS[name](ctx)
            rows += new_rows
        except Exception as exc:  # the other checks still run: one try on a lent GPU tells all it can
            traceback.print_exc()
            failed.append(name)
            rows.append(Row(f"{name}: FAILED", f"{type(exc).__name__}", "", "", str(exc).splitlines()[0][:300]))
        spent[name] = time.perf_counter() - began
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"{name}: {spent[name]:.1f} s", flush=True)
    total = time.perf_counter() - start
    rows.append(Row("wall time", f"{total:.0f} s", "", "", ", ".join(f"{k} {v:.0f} s" for k, v in spent.items())))
    print(table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "device": device, "rows": [asdict(r) for r in rows],
                       "figures": figures, "seconds": spent, "failed": failed}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
