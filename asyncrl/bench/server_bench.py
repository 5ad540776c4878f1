"""SGLang or vLLM beside the embedded engine (`asyncrl bench engine` run in the server's own
environment: `.venv-sglang` with `engine=sglang_cpu` or `engine=sglang`, `.venv-vllm` with
`engine=vllm`):

* tokens/s at batch 1, 16 and 64 and the time to the first token, on the same prompts, paired
  rounds (server, embedded, server, ...). Every response is exactly `new_tokens` long (EOS held
  back on both sides), and the server's prefix cache is emptied before each run, so both prefill
  every prompt;
* the seconds a weight update costs, into the idle server and into the embedded engine, by the
  node's shared-memory slot (`adopt_shared`, a generator beside its learner) and by the tensors
  themselves (`update_weights`, a generator on another node), median of the rounds.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import numpy as np
import torch

from asyncrl.config import Config
from asyncrl.data.files import load_examples
from asyncrl.data.tasks import encode_prompt
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import build_engine, sequence_input
from asyncrl.weights.shared_memory import SharedSlots

SERVERS = {"sglang": "SGLang", "vllm": "vLLM"}


class LoopEngine:
    """The run's server engine (`engine.name`: SGLang or vLLM) with its coroutines on an event loop
    of their own thread; plain calls here."""

    def __init__(self, config: Config, seed: int = 0):
        self.name = config.engine.name
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():  # built on the loop it will run on
            if self.name == "vllm":
                from asyncrl.engines.vllm_launch import start_vllm

                return start_vllm(config.model, config.engine, seed)
            from asyncrl.engines.sglang_launch import start_sglang

            return start_sglang(config.model, config.engine, seed)

        self.engine = self.call(start())

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def generate(self, sequences, window_tokens: int, params: SamplingParams):
        return self.call(self.engine.generate_window(sequences, window_tokens, params))

    def flush_cache(self) -> None:
        if self.name == "vllm":
            self.call(self.engine.engine.reset_prefix_cache())
        else:
            self.call(self.engine.engine.tokenizer_manager.flush_cache())

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def engine_speed(config: Config, quick: bool) -> dict:
    torch.set_num_threads(config.engine.threads)
    embedded, tokenizer = build_engine(config.model)
    server = LoopEngine(config)
    name = server.name
    new_tokens = 16 if quick else 64
    batches = (1, 4) if quick else (1, 16, 64)
    rounds = 1 if quick else 3
    examples = load_examples(config.task, "eval", max(batches))
    prompts = [encode_prompt(ex, tokenizer, config.model.use_chat_template, config.task.chat_template_kwargs) for ex in examples]
    results = {}
    try:
        for batch in batches:
            timings = paired_timings(server, embedded, [prompts[i % len(prompts)] for i in range(batch)], new_tokens,
                                     rounds)
            results[f"batch_{batch}"] = {
                f"{name}_tokens_per_s": float(np.median([batch * new_tokens / t for t in timings[name]])),
                "embedded_tokens_per_s": float(np.median([batch * new_tokens / t for t in timings["embedded"]])),
                f"ratio_{name}_over_embedded": float(np.median([e / s for s, e in zip(timings[name],
                                                                                    timings["embedded"])])),
                f"{name}_first_token_s": float(np.median(timings[f"{name}_ttft"])),
                "embedded_first_token_s": float(np.median(timings["embedded_ttft"])),
                "new_tokens": new_tokens, "rounds": rounds, "device": config.engine.device,
                "embedded_threads": config.engine.threads,
            }
            print(f"batch {batch}: {results[f'batch_{batch}']}", flush=True)
        results["weight_update"] = update_seconds(server, embedded, 2 if quick else 5)
        print(f"weight update: {results['weight_update']}", flush=True)
    finally:
        server.close()
    return results


def paired_timings(server: LoopEngine, embedded, chosen: list, new_tokens: int, rounds: int) -> dict:
    """Seconds of each run, server and embedded in turns: whole responses and first tokens."""
    params = SamplingParams(temperature=1.0)
    full = [sequence_input(p, i, new_tokens, min_response_tokens=new_tokens) for i, p in enumerate(chosen)]
    first = [sequence_input(p, i, 1) for i, p in enumerate(chosen)]
    name = server.name
    timings = {name: [], "embedded": [], f"{name}_ttft": [], "embedded_ttft": []}
    for _ in range(rounds):
        for who, run in ((name, server.generate), ("embedded", embedded.generate_window_sync)):
            for key, sequences, window in ((who, full, new_tokens), (f"{who}_ttft", first, 1)):
                if who == name:
                    server.flush_cache()
                start = time.perf_counter()
                outputs = run(sequences, window, params)
                timings[key].append(time.perf_counter() - start)
                if sum(len(o.token_ids) for o in outputs) != len(chosen) * window:
                    raise RuntimeError(f"{who} generated other lengths than {window} tokens a row")
    return timings


def update_seconds(server: LoopEngine, embedded, rounds: int) -> dict:
    """Median seconds of a whole version loaded into the idle server and into the embedded engine,
    by shared memory and by tensors (each version differs from the last)."""
    weights = {n: p.detach().clone().float() for n, p in embedded.model.named_parameters()}
    slots = SharedSlots()
    out = {"bytes": sum(t.numel() * t.element_size() for t in weights.values()), "rounds": rounds}
    try:
        for who, engine in ((server.name, server.engine), ("embedded", embedded)):
            for path in ("shm", "tensors"):
                times = []
                for _ in range(rounds):
                    next(iter(weights.values())).add_(1e-3)
                    version = engine.weight_version + 1
                    start = time.perf_counter()
                    if path == "shm":
                        engine.adopt_shared(slots.write(weights.items()), version)
                    else:
                        engine.update_weights(list(weights.items()), version)
                    times.append(time.perf_counter() - start)
                out[f"{who}_{path}_s"] = statistics.median(times)
    finally:
        slots.close()
    return out


def engine_report(results: dict) -> str:
    name = next(n for n in SERVERS if f"{n}_tokens_per_s" in results.get("batch_1", {}))
    label = SERVERS[name]
    lines = [f"| batch | {label} tok/s | embedded tok/s | {label} / embedded | {label} first token s | "
             "embedded first token s |", "|---|---|---|---|---|---|"]
    for key, r in results.items():
        if key.startswith("batch_"):
            lines.append(f"| {key.removeprefix('batch_')} | {r[f'{name}_tokens_per_s']:.1f} | "
                         f"{r['embedded_tokens_per_s']:.1f} | {r[f'ratio_{name}_over_embedded']:.2f}x | "
                         f"{r[f'{name}_first_token_s']:.3f} | {r['embedded_first_token_s']:.3f} |")
    update = results.get("weight_update")
    if update:
        lines.append(f"weight update ({update['bytes'] / 1e6:.0f} MB, median of {update['rounds']}): {label} "
                     f"{update[f'{name}_shm_s']:.3f} s by shared memory, {update[f'{name}_tensors_s']:.3f} s by "
                     f"tensors; embedded {update['embedded_shm_s']:.3f} s / {update['embedded_tensors_s']:.3f} s")
    return "\n".join(lines)
