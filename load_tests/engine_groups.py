"""Batch 64 as a GRPO generator makes it: 8 prompts x 8 samples each, 32 new tokens at temperature 1,
the embedded model in fp32 on one thread. The engine (`TorchEngine.generate_window_sync`, which
computes what rows' prompts share once) against `model.generate(num_return_sequences=8)`, by CPU
time, 2 rounds after a warm-up; prints the best of each and their ratio.

    python load_tests/engine_groups.py
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS, SAMPLES, NEW_TOKENS = 8, 8, 32


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import torch

    from asyncrl.bench.engine import NEVER
    from asyncrl.config import compose
    from asyncrl.datafiles import load_examples
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.generation import sequence_input
    from asyncrl.models import load_policy
    from asyncrl.tasks import encode_prompt

    torch.set_num_threads(1)
    config = compose([])
    model, tokenizer = load_policy(config.model)
    model.eval()
    pad = tokenizer.pad_token_id or 0
    prompts = [encode_prompt(e, tokenizer, config.model.use_chat_template, config.task.chat_template_kwargs)
               for e in load_examples(config.task, "eval", PROMPTS)][:PROMPTS]
    engine = TorchEngine(model, NEVER, pad)
    sequences = [sequence_input(p, i, NEW_TOKENS) for i, p in enumerate(p for p in prompts for _ in range(SAMPLES))]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def engine_call():
        engine.generate_window_sync(sequences, NEW_TOKENS, SamplingParams(temperature=1.0))

    def generate_call():
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad,
                           num_return_sequences=SAMPLES)

    rates: dict[str, list[float]] = {"engine": [], "generate": []}
    for round_ in range(3):  # round 0 warms up
        for name, call in (("engine", engine_call), ("generate", generate_call)):
            start = time.process_time()
            call()
            if round_:
                rates[name].append(PROMPTS * SAMPLES * NEW_TOKENS / (time.process_time() - start))
    best = {name: max(r) for name, r in rates.items()}
    print(json.dumps({"tokens_per_cpu_s": best, "engine_over_generate": best["engine"] / best["generate"]}))


if __name__ == "__main__":
    main()
