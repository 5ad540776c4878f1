"""SGLang in the benchmarks (in .venv-sglang, with `engine=sglang_cpu` or `engine=sglang`):

* `asyncrl bench engine engine=sglang_cpu`: SGLang beside the embedded engine on the same prompts,
  tokens/s at batch 1, 16 and 64 and the time to the first token, paired rounds (SGLang, embedded,
  SGLang, ...). Every response is exactly `new_tokens` long (EOS held back on both sides), and
  SGLang's prefix cache is flushed before each run, so both prefill every prompt.
* `asyncrl bench broadcast engine=sglang_cpu`: a weight update into a running SGLang engine by its
  two paths, beside the embedded engine's `shm`: `sglang_shm` (the version written to the learner's
  shared-memory slot, SGLang's scheduler maps it and copies it into its parameters) and
  `sglang_tensors` (the tensors themselves through `update_weights_from_tensor`, as a generator on
  another node loads what it received). Each update is checked: SGLang's copy of the changed tensor
  is read back.
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


class LoopEngine:
    """A SGLang engine whose coroutines run on an event loop of their own thread; plain calls here."""

    def __init__(self, config: Config, seed: int = 0):
        from asyncrl.engines.sglang_launch import start_sglang

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():  # built on the loop it will run on
            return start_sglang(config.model, config.engine, seed)

        self.engine = self.call(start())

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def generate(self, sequences, window_tokens: int, params: SamplingParams):
        return self.call(self.engine.generate_window(sequences, window_tokens, params))

    def flush_cache(self) -> None:
        self.call(self.engine.engine.tokenizer_manager.flush_cache())

    def first_values(self, name: str, count: int) -> np.ndarray:
        """The first values of SGLang's copy of a parameter (read back from its scheduler)."""
        from sglang.srt.managers.io_struct import GetWeightsByNameReqInput

        values = self.call(self.engine.engine.tokenizer_manager.get_weights_by_name(
            GetWeightsByNameReqInput(name=name, truncate_size=count), None))
        return np.asarray(values, dtype=np.float32).reshape(-1)[:count]

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def engine_speed(config: Config, quick: bool) -> dict:
    torch.set_num_threads(config.engine.threads)
    embedded, tokenizer = build_engine(config.model)
    sglang = LoopEngine(config)
    new_tokens = 16 if quick else 64
    batches = (1, 4) if quick else (1, 16, 64)
    rounds = 1 if quick else 3
    examples = load_examples(config.task, "eval", max(batches))
    prompts = [encode_prompt(ex, tokenizer, config.model.use_chat_template, config.task.chat_template_kwargs) for ex in examples]
    params = SamplingParams(temperature=1.0)
    results = {}
    try:
        for batch in batches:
            chosen = [prompts[i % len(prompts)] for i in range(batch)]
            full = [sequence_input(p, i, new_tokens, min_response_tokens=new_tokens) for i, p in enumerate(chosen)]
            first = [sequence_input(p, i, 1) for i, p in enumerate(chosen)]
            timings = {"sglang": [], "embedded": [], "sglang_ttft": [], "embedded_ttft": []}
            for _ in range(rounds):
                for name, run in (("sglang", sglang.generate), ("embedded", embedded.generate_window_sync)):
                    for key, sequences, window in ((name, full, new_tokens), (f"{name}_ttft", first, 1)):
                        if name == "sglang":
                            sglang.flush_cache()
                        start = time.perf_counter()
                        outputs = run(sequences, window, params)
                        timings[key].append(time.perf_counter() - start)
                        if sum(len(o.token_ids) for o in outputs) != batch * window:
                            raise RuntimeError(f"{name} generated other lengths than {window} tokens a row")
            results[f"batch_{batch}"] = {
                "sglang_tokens_per_s": float(np.median([batch * new_tokens / t for t in timings["sglang"]])),
                "embedded_tokens_per_s": float(np.median([batch * new_tokens / t for t in timings["embedded"]])),
                "ratio_sglang_over_embedded": float(np.median([e / s for s, e in zip(timings["sglang"],
                                                                                   timings["embedded"])])),
                "sglang_first_token_s": float(np.median(timings["sglang_ttft"])),
                "embedded_first_token_s": float(np.median(timings["embedded_ttft"])),
                "new_tokens": new_tokens, "rounds": rounds, "device": config.engine.device,
                "embedded_threads": config.engine.threads,
            }
            print(f"batch {batch}: {results[f'batch_{batch}']}", flush=True)
    finally:
        sglang.close()
    return results


def engine_report(results: dict) -> str:
    lines = ["| batch | SGLang tok/s | embedded tok/s | SGLang / embedded | SGLang first token s | embedded first token s |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name.removeprefix('batch_')} | {r['sglang_tokens_per_s']:.1f} | {r['embedded_tokens_per_s']:.1f} | "
                     f"{r['ratio_sglang_over_embedded']:.2f}x | {r['sglang_first_token_s']:.3f} | "
                     f"{r['embedded_first_token_s']:.3f} |")
    return "\n".join(lines)


def update_speed(config: Config, rounds: int, memcpy_seconds) -> dict:
    """Seconds per update into an idle SGLang engine by each path, beside a copy of the same bytes
    (`memcpy_seconds(bytes, rounds)`, the broadcast benchmark's ceiling)."""
    from asyncrl.models.loading import load_policy

    model, _ = load_policy(config.model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    probe = "model.embed_tokens.weight"
    sglang = LoopEngine(config)
    slots = SharedSlots()
    out = {}
    try:
        for path in ("sglang_shm", "sglang_tensors"):
            times = []
            for _ in range(rounds):
                weights[probe].add_(1.0)  # every version differs: read back below
                version = sglang.engine.weight_version + 1
                start = time.perf_counter()
                if path == "sglang_shm":
                    sglang.engine.adopt_shared(slots.write(weights.items()), version)
                else:
                    sglang.engine.update_weights(list(weights.items()), version)
                times.append(time.perf_counter() - start)
                landed = sglang.first_values(probe, 8)
                if not np.allclose(landed, weights[probe].reshape(-1)[:8].numpy(), atol=1e-6):
                    raise RuntimeError(f"{path}: SGLang holds other weights than version {version}")
            copy = statistics.median(memcpy_seconds(total, rounds))
            out[path] = {"parameters": sum(t.numel() for t in weights.values()), "bytes": total, "rounds": rounds,
                         "seconds_per_update_median": statistics.median(times), "first_update_s": times[0],
                         "bytes_per_s_median": total / statistics.median(times), "memcpy_s_median": copy,
                         "memcpy_bytes_per_s_median": total / copy,
                         "memcpy_bandwidth_share": copy / statistics.median(times)}
    finally:
        slots.close()
        sglang.close()
    return out
