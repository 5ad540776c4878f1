"""Batch 64 as a GRPO generator makes it: 8 prompts x 8 samples each, 32 new tokens at temperature 1,
the embedded model in fp32 on one thread. The engine (`TorchEngine.generate_window_sync`, which
computes what rows' prompts share once) against `model.generate(num_return_sequences=8)`, by CPU
time, 2 rounds after a warm-up; prints the best of each and their ratio.

    python load_tests/engine_groups.py
"""
import json, time, torch
from asyncrl.config import compose
from asyncrl.models import load_policy
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.engines.base import SamplingParams
from asyncrl.bench.engine import NEVER
from asyncrl.generation import sequence_input
from asyncrl.datafiles import load_examples
from asyncrl.tasks import encode_prompt

torch.set_num_threads(1)
config = compose([])
model, tok = load_policy(config.model)
model.eval()
pad = tok.pad_token_id or 0
ex = load_examples(config.task, "eval", 8)
prompts = [encode_prompt(e, tok, config.model.use_chat_template, config.task.chat_template_kwargs) for e in ex][:8]
rows = [p for p in prompts for _ in range(8)]
engine = TorchEngine(model, NEVER, pad)
seqs = [sequence_input(p, i, 32) for i, p in enumerate(rows)]
width = max(len(p) for p in prompts)
ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
def eng(): engine.generate_window_sync(seqs, 32, SamplingParams(temperature=1.0))
def gen():
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=True,
                       temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad, num_return_sequences=8)
out = {"engine": [], "generate": []}
for r in range(3):
    for name, f in (("engine", eng), ("generate", gen)):
        t = time.process_time(); f(); dt = time.process_time() - t
        if r: out[name].append(64 * 32 / dt)
print(json.dumps({k: max(v) for k, v in out.items()}), "ratio", max(out["engine"]) / max(out["generate"]))
