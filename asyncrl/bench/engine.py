"""Embedded engine speed, side by side in one run, on the same prompts and length (every row
generates exactly `new_tokens`: EOS is never sampled), paired rounds:

* `engine`: `TorchEngine` as the generators run it (`engine.dtype=auto`: bfloat16 where this
  machine's probe measured it faster, `asyncrl.models.precision`);
* `engine_fp32`: the same engine in float32 (what bfloat16 brings, apart from the rest);
* `generate`: transformers' `generate` on a float32 model, as a user calls it;
* SGLang and vLLM on this CPU, from `.venv-sglang` and `.venv-vllm` (their own benchmark,
  `engine=sglang_cpu` / `engine=vllm`, run as a subprocess); each skipped with a message where its
  environment is absent or refuses the model. Run inside `.venv-sglang` with `engine=sglang_cpu`
  (or `engine=sglang`), or inside `.venv-vllm` with `engine=vllm`, this benchmark is the server's
  own (`asyncrl.bench.server_bench`: the server beside the embedded engine, tokens/s, first token
  and the seconds of a weight update).

Each figure is also a share of the *decode ceiling* at that batch: the model's matmul FLOPs per
token against this CPU's measured throughput for the model's own matmul shapes at that batch, in
the variant's dtype and thread count (attention, sampling and everything else counted as free, so
the ceiling is an upper bound).

The last row is the batch a GRPO generator runs: groups of rows sharing a prompt (8 prompts x 8
samples at batch 64), the engine handed the rows (it prefills each prompt once), `generate` the
prompts with `num_return_sequences`.

A second table times responses generated window by window (T-PPO's small windows), with the KV
caches kept between windows against re-reading every context (`max_kept_bytes=0`).

A third times the engine on random models of the benchmarked model's size in each family its own
forward knows (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms), paired rounds, each Qwen
against the Llama shape.

Every call is timed twice: wall time, and the process's CPU time. With one thread (the
generators' setting) CPU time is what the work cost, whatever else the machine runs (other jobs
take the cores in turns: wall time then counts their turns too); shares of the ceiling and the
ceiling's matmul timings use it, and the ratios are given by both clocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from asyncrl.config import compose
from asyncrl.data.files import load_examples
from asyncrl.data.tasks import encode_prompt
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import sequence_input
from asyncrl.engines.torch_engine import TorchEngine, engine_precision
from asyncrl.models.loading import load_policy
from asyncrl.models.precision import device_name

ROOT = Path(__file__).resolve().parents[2]
NEVER = [-1]  # an EOS id no token has: every row runs its full length


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    load_start = os.getloadavg()[0]
    config = compose(overrides or [])
    if config.engine.name in ("sglang", "vllm"):  # the server beside the embedded engine (.venv-sglang, .venv-vllm)
        from asyncrl.bench.server_bench import engine_speed

        return engine_speed(config, quick)
    threads, device = config.engine.threads, config.engine.device
    torch.set_num_threads(threads)
    user_model, tokenizer = load_policy(config.model)  # float32, as a user loads it for `generate`
    batches = (1, 4) if quick else (1, 16, 64, 256) if device == "cuda" else (1, 16, 64)
    precision = engine_precision(config.engine.dtype, device, user_model, max(batches))
    dtype = precision.dtype
    user_model = user_model.to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engines = {"engine": TorchEngine(user_model, NEVER, pad, dtype=dtype), "engine_fp32": TorchEngine(user_model, NEVER, pad)}
    new_tokens = 16 if quick else 64
    rounds = 1 if quick else 3
    examples = load_examples(config.task, "eval", max(batches))
    prompts = [encode_prompt(ex, tokenizer, config.model.use_chat_template, config.task.chat_template_kwargs) for ex in examples]
    setup = {"dtype": str(dtype).removeprefix("torch."), "threads": threads, "device": device, "new_tokens": new_tokens,
             "rounds": rounds, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
             "processor": device_name(device), "precision": precision.summary(),
             "mean_prompt_tokens": float(np.mean([len(p) for p in prompts[:max(batches)]]))}
    context = setup["mean_prompt_tokens"] + new_tokens / 2
    # Distinct prompts at each batch, then the batch a GRPO generator runs: groups of rows that
    # share a prompt (the engine prefills it once; `generate` gets `num_return_sequences`).
    group_batch, group_size = (4, 2) if quick else (64, 8)
    shapes = [(f"batch_{b}", b, 1) for b in batches] + [(f"groups_{group_batch}", group_batch, group_size)]
    results, ceilings = {}, {}
    for name, batch, samples in shapes:
        if batch not in ceilings:
            by_dtype = {dt: decode_ceiling(user_model, batch, dt, context, device, threads) for dt in {dtype, torch.float32}}
            ceilings[batch] = {"engine": by_dtype[dtype], "engine_fp32": by_dtype[torch.float32],
                               "generate": by_dtype[torch.float32]}
        chosen = [prompts[i % len(prompts)] for i in range(batch // samples)]
        timings = paired_rounds(engines, user_model, chosen, new_tokens, pad, rounds, device, samples)
        results[name] = batch_row(batch, samples, new_tokens, threads, timings, ceilings[batch])
        print(f"{name}: {results[name]}", flush=True)
    windowed = kept_cache_rounds(engines["engine"], prompts, quick, rounds)
    del engines
    families = family_rounds(user_model, dtype, prompts, pad, (4,) if quick else (16, 64), new_tokens, rounds, device)
    servers = {name: server_figures(name, quick, overrides or []) for name in ("sglang", "vllm")}
    # Other jobs on the machine slow every variant; the paired ratios hold better than the rates.
    setup["load_average_1min_start_end"] = [load_start, os.getloadavg()[0]]
    return {"setup": setup, "batches": results, "windows": windowed, "families": families, **servers}


def batch_row(batch: int, samples: int, new_tokens: int, threads: int, timings: tuple[dict, dict],
              ceilings: dict) -> dict:
    """One row of the table: tokens/s by wall and CPU clock, shares of the ceiling, paired ratios."""
    wall, cpu = timings
    row = {"batch": batch, "samples_per_prompt": samples}
    for name in wall:
        row[f"{name}_tokens_per_s"] = float(np.median([batch * new_tokens / t for t in wall[name]]))
        row[f"{name}_tokens_per_cpu_s"] = float(np.median([batch * new_tokens / t for t in cpu[name]]))
        row[f"{name}_ceiling_tokens_per_s"] = ceilings[name]["tokens_per_s"]
        measured = row[f"{name}_tokens_per_cpu_s" if threads == 1 else f"{name}_tokens_per_s"]
        row[f"{name}_share_of_ceiling"] = measured / ceilings[name]["tokens_per_s"]
    for name in ("engine", "engine_fp32"):  # paired: the median of the per-round ratios
        row[f"{name}_over_generate"] = float(np.median([g / e for e, g in zip(wall[name], wall["generate"])]))
        row[f"{name}_over_generate_cpu"] = float(np.median([g / e for e, g in zip(cpu[name], cpu["generate"])]))
    row["matmul_gflops"] = {name: c["matmul_gflops"] for name, c in ceilings.items() if name != "engine_fp32"}
    return row


def paired_rounds(engines: dict, user_model, prompts: list[list[int]], new_tokens: int, pad: int, rounds: int,
                  device: str, samples: int = 1) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds per call of each variant, one call each per round after a warm-up round.
    With `samples` > 1 each prompt gets that many rows, as a GRPO group: the engine is handed the
    rows (it computes what they share once), `generate` the prompts with `num_return_sequences`."""
    rows = [p for p in prompts for _ in range(samples)]
    sequences = [sequence_input(p, i, new_tokens) for i, p in enumerate(rows)]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    calls = {name: (lambda e=engine: e.generate_window_sync(sequences, new_tokens, SamplingParams(temperature=1.0)))
             for name, engine in engines.items()}

    def generate():
        with torch.inference_mode():
            user_model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                pad_token_id=pad, num_return_sequences=samples)

    calls["generate"] = generate
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds + 1):
        for name, call in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            if round_:  # round 0 warms up (allocator, one-off kernel setup)
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def decode_ceiling(model, batch: int, dtype: torch.dtype, context: float, device: str, threads: int) -> dict:
    """Tokens/s if the model's matmuls ran at this CPU's measured speed for their shapes at
    `batch` rows and nothing else cost anything. FLOPs per token: 2 per weight of every linear
    layer (the LM head included) plus attention's 4 per head dimension per context token."""
    shapes: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            key = (module.in_features, module.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    flops = seconds = 0.0
    for (fan_in, fan_out), count in shapes.items():
        x = torch.randn(batch, fan_in, dtype=dtype, device=device)
        w = torch.randn(fan_out, fan_in, dtype=dtype, device=device)
        seconds += count * seconds_per_call(lambda: torch.nn.functional.linear(x, w),
                                            time.process_time if threads == 1 and device == "cpu" else time.perf_counter)
        flops += count * 2.0 * batch * fan_in * fan_out
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4.0 * config.num_hidden_layers * config.num_attention_heads * head_dim * context
    per_token = flops / batch + attention
    throughput = flops / seconds
    return {"tokens_per_s": throughput / per_token, "matmul_gflops": throughput / 1e9, "flops_per_token": per_token}


def seconds_per_call(fn, clock=time.perf_counter, min_seconds: float = 0.2) -> float:
    """The fastest of five timings by `clock`, each a loop of at least `min_seconds` (other jobs
    on the machine only ever slow a loop down)."""
    fn()
    best = float("inf")
    for _ in range(5):
        n, start = 0, clock()
        while (elapsed := clock() - start) < min_seconds or n == 0:
            fn()
            n += 1
        best = min(best, elapsed / n)
    return best


def kept_cache_rounds(engine: TorchEngine, prompts: list[list[int]], quick: bool, rounds: int) -> dict:
    """Responses of `length` tokens in windows of `window`, at `batch` rows: tokens/s with the KV
    caches kept between windows against every window re-reading its context."""
    batch, length, window = (4, 32, 8) if quick else (64, 128, 16)
    chosen = [prompts[i % len(prompts)] for i in range(batch)]
    bound = engine.kept.max_bytes

    def respond(keep: bool) -> tuple[float, float]:
        engine.kept.max_bytes = bound if keep else 0
        responses = [np.zeros(0, dtype=np.int32) for _ in chosen]
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(length // window):
            outs = engine.generate_window_sync(
                [sequence_input(p, i, length, responses[i], key=f"bench/{i}") for i, p in enumerate(chosen)],
                window, SamplingParams(temperature=1.0))
            responses = [np.concatenate([r, o.token_ids]) for r, o in zip(responses, outs)]
        return time.perf_counter() - start, time.process_time() - start_cpu

    times: dict[str, list[tuple[float, float]]] = {"kept": [], "re_read": []}
    try:
        for _ in range(rounds):
            for name, keep in (("kept", True), ("re_read", False)):
                times[name].append(respond(keep))
    finally:
        engine.kept.max_bytes = bound
    out = {"batch": batch, "response_tokens": length, "window_tokens": window}
    for clock, suffix in ((0, "s"), (1, "cpu_s")):
        for name, ts in times.items():
            out[f"{name}_tokens_per_{suffix}"] = float(np.median([batch * length / t[clock] for t in ts]))
        out[f"kept_over_re_read{'' if clock == 0 else '_cpu'}"] = float(
            np.median([r[clock] / k[clock] for k, r in zip(times["kept"], times["re_read"])]))
    return out


def family_models(like, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random models of `like`'s size (widths, depth, heads, vocabulary, tied head) in each family
    the engine's own forward knows, in `dtype`: Llama; Qwen2 (biases on q/k/v); Qwen3 (q/k
    RMSNorm per head, its `head_dim` set to `like`'s)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    c = like.config
    shape = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                 num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                 num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                 tie_word_embeddings=c.tie_word_embeddings, rms_norm_eps=c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    built = {"llama": (LlamaForCausalLM, LlamaConfig(**shape)), "qwen2": (Qwen2ForCausalLM, Qwen2Config(**shape)),
             "qwen3": (Qwen3ForCausalLM, Qwen3Config(**shape, head_dim=head_dim))}
    torch.manual_seed(seed)
    return {name: cls(config).to(dtype).eval() for name, (cls, config) in built.items()}


def family_rounds(like, dtype: torch.dtype, prompts: list[list[int]], pad: int, batches: tuple[int, ...],
                  new_tokens: int, rounds: int, device: str) -> dict:
    """The engine (in `dtype`) on `family_models(like)`: tokens/s per family at each batch, and each
    family's paired ratio to the Llama shape (median over rounds; every family once a round)."""
    models = family_models(like, dtype)
    engines = {name: TorchEngine(model.to(device), NEVER, pad) for name, model in models.items()}
    out = {"families": {name: e.decoder is not None for name, e in engines.items()},
           "parameters": {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}}
    for batch in batches:
        sequences = [sequence_input(prompts[i % len(prompts)], i, new_tokens) for i in range(batch)]
        for engine in engines.values():  # warm-up
            engine.generate_window_sync(sequences, 2, SamplingParams(temperature=1.0))
        wall: dict[str, list[float]] = {name: [] for name in engines}
        cpu: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(rounds):
            for name, engine in engines.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                engine.generate_window_sync(sequences, new_tokens, SamplingParams(temperature=1.0))
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
        row = {"batch": batch}
        for name in engines:
            row[f"{name}_tokens_per_s"] = float(np.median([batch * new_tokens / t for t in wall[name]]))
            row[f"{name}_tokens_per_cpu_s"] = float(np.median([batch * new_tokens / t for t in cpu[name]]))
            row[f"{name}_over_llama"] = float(np.median([l / t for t, l in zip(wall[name], wall["llama"])]))
            row[f"{name}_over_llama_cpu"] = float(np.median([l / t for t, l in zip(cpu[name], cpu["llama"])]))
        out[f"batch_{batch}"] = row
        print(f"families, batch {batch}: {row}", flush=True)
    return out


def server_figures(name: str, quick: bool, overrides: list[str]) -> dict:
    """SGLang's or vLLM's tokens/s at the same batches and its weight update's seconds, from its own
    benchmark in `.venv-sglang` / `.venv-vllm` (this checkout's, or the checkout
    `ASYNCRL_SGLANG_ROOT` / `ASYNCRL_VLLM_ROOT` names)."""
    root = Path(os.environ.get(f"ASYNCRL_{name.upper()}_ROOT", ROOT))
    python = root / f".venv-{name}" / "bin" / "python"
    label = {"sglang": "SGLang", "vllm": "vLLM"}[name]
    if not python.exists():
        return {"skipped": f"{python} is missing ({label} on CPU: `make {name}` builds it)"}
    with tempfile.TemporaryDirectory() as run_dir:
        preset = "sglang_cpu" if name == "sglang" else name
        command = [str(python), "-m", "asyncrl.cli", "bench", "engine", f"engine={preset}", *overrides,
                   *(["--quick"] if quick else []), "--run-dir", run_dir]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True)
        if done.returncode != 0:
            return {"skipped": f"{label}'s benchmark failed (exit {done.returncode}): {done.stderr.strip()[-600:]}"}
        with open(os.path.join(run_dir, "bench_engine.json")) as f:
            result = json.load(f)
    figures = {key: {f"{name}_tokens_per_s": r[f"{name}_tokens_per_s"]} for key, r in result.items()
               if key.startswith("batch_")}
    return {**figures, "weight_update": result.get("weight_update")}


def report(result: dict) -> str:
    if "setup" not in result:  # SGLang's or vLLM's own benchmark (engine=sglang_cpu, engine=vllm)
        from asyncrl.bench.server_bench import engine_report

        return engine_report(result)
    s = result["setup"]
    lines = [f"{s['processor']} ({s['cpu_capability']}): engine dtype {s['dtype']} ({s['precision']['reason']}), {s['threads']} "
             f"thread(s), {s['new_tokens']} new tokens a row, median of {s['rounds']} paired rounds (load average "
             f"{s['load_average_1min_start_end'][0]:.1f} -> {s['load_average_1min_start_end'][1]:.1f}); "
             f"tok/s by wall clock / by CPU time (share of the decode ceiling); ratios by wall / CPU time",
             "| batch | engine | engine fp32 | HF generate fp32 | SGLang | vLLM | engine / generate | engine fp32 / generate "
             "| ceiling tok/s: engine, fp32 | matmul GFLOP/s: engine, fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    servers = {name: result.get(name, {"skipped": "not run"}) for name in ("sglang", "vllm")}
    for name, r in result["batches"].items():
        cells = [f"{r[f'{v}_tokens_per_s']:.1f} / {r[f'{v}_tokens_per_cpu_s']:.1f} ({r[f'{v}_share_of_ceiling']:.0%})"
                 for v in ("engine", "engine_fp32", "generate")]
        theirs = " | ".join(f"{figures[name][f'{server}_tokens_per_s']:.1f}" if name in figures else "-"
                            for server, figures in servers.items())
        ratios = [f"{r[f'{v}_over_generate']:.2f}x / {r[f'{v}_over_generate_cpu']:.2f}x" for v in ("engine", "engine_fp32")]
        samples = r.get("samples_per_prompt", 1)
        label = f"{r['batch']} ({r['batch'] // samples} prompts x {samples})" if samples > 1 else f"{r['batch']}"
        lines.append(f"| {label} | {' | '.join(cells)} | {theirs} | {' | '.join(ratios)} | "
                     f"{r['engine_ceiling_tokens_per_s']:.0f}, {r['generate_ceiling_tokens_per_s']:.0f} | "
                     f"{r['matmul_gflops']['engine']:.0f}, {r['matmul_gflops']['generate']:.0f} |")
    for server, figures in servers.items():
        if "skipped" in figures:
            lines.append(f"{server}: skipped: {figures['skipped']}")
        elif figures.get("weight_update"):
            u = figures["weight_update"]
            lines.append(f"{server}: a weight update ({u['bytes'] / 1e6:.0f} MB) {u[f'{server}_shm_s']:.3f} s by shared "
                         f"memory, {u[f'{server}_tensors_s']:.3f} s by tensors; embedded {u['embedded_shm_s']:.3f} s / "
                         f"{u['embedded_tensors_s']:.3f} s")
    w = result["windows"]
    lines.append(f"windows: batch {w['batch']}, {w['response_tokens']} tokens in windows of {w['window_tokens']}: "
                 f"KV kept {w['kept_tokens_per_s']:.1f} / {w['kept_tokens_per_cpu_s']:.1f} tok/s, re-read "
                 f"{w['re_read_tokens_per_s']:.1f} / {w['re_read_tokens_per_cpu_s']:.1f} tok/s (wall / CPU), "
                 f"{w['kept_over_re_read']:.2f}x / {w['kept_over_re_read_cpu']:.2f}x")
    f = result["families"]
    lines += [f"families: random models of this size, engine {s['dtype']}, tok/s by wall clock / by CPU time, paired "
              f"ratios to the Llama shape by wall / CPU time; own forward: {f['families']}",
              "| batch | llama | qwen2 | qwen3 | qwen2 / llama | qwen3 / llama |", "|---|---|---|---|---|---|"]
    for name, r in f.items():
        if name.startswith("batch_"):
            cells = [f"{r[f'{v}_tokens_per_s']:.1f} / {r[f'{v}_tokens_per_cpu_s']:.1f}" for v in ("llama", "qwen2", "qwen3")]
            ratios = [f"{r[f'{v}_over_llama']:.2f}x / {r[f'{v}_over_llama_cpu']:.2f}x" for v in ("qwen2", "qwen3")]
            lines.append(f"| {r['batch']} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    return "\n".join(lines)
