"""Would int8 matrix products make the embedded engine fast on a CPU without native bf16? (issue 43,
`docs/benchmarks.md` section 7, "On a CPU without AMX")

On a CPU with AVX2 only, bf16 products are emulated (7x slower than fp32) and the engine's decode is
three quarters fp32 matmuls, so int8 is the one faster arithmetic left. This script measures both
halves of the question on the model's own linear shapes and weights, one torch thread:

- speed: one pass over every linear layer of the model (each shape times its count) at 16 and 64
  rows, in fp32, bf16 and int8 (PyTorch's dynamic int8 linear: per-channel int8 weights,
  activations quantized per call, FBGEMM's or oneDNN's kernel);
- what int8 does to the sampled distribution: per response token, KL(fp32 || variant) and the
  change of the sampled token's log-prob, teacher-forced over the task's prompts with responses
  the fp32 model sampled. Variants: bf16 weights (the engine's bf16), int8 weights with fp32
  activations, int8 weights and activations quantized per row (8 bits, the best case of any
  W8A8 kernel, computed exactly in fp32), and PyTorch's dynamic int8 linear itself (its kernel:
  activations quantized per call, 7 bits on x86 without VNNI, so a row's numbers also depend on
  the other rows of its batch).

    python load_tests/int8_products.py                   # the embedded model: ~3 minutes
    python load_tests/int8_products.py --prompts 4 model=tiny task=tiny

Prints one table for each half. PyTorch's quantized tensors are deprecated (torch 2.13 warns that
they will be removed): another reason a measurement, not the engine, uses them.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
import torch.nn.functional as F

ROWS = (16, 64)
VARIANTS = ("bf16", "int8 weights", "int8 W8A8 per row", "int8 dynamic (torch)")


def int8_dynamic(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose linear layers are PyTorch's dynamic int8 linear (per-channel weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(module), {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig},
            dtype=torch.qint8)


def _seconds(call, repeats: int = 3) -> float:
    """The fastest of `repeats` timings of `call` (process CPU time, so another job does not count)."""
    call()  # warm-up: kernels are chosen and weights packed on the first call
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        call()
        best = min(best, time.process_time() - start)
    return best


def product_seconds(model: torch.nn.Module, rows: int) -> dict[str, float]:
    """Seconds for one pass over the model's linear layers at `rows` rows, per dtype."""
    from asyncrl.models.precision import linear_shapes

    totals = {"fp32": 0.0, "bf16": 0.0, "int8": 0.0}
    with torch.inference_mode():
        for fan_in, fan_out, count in linear_shapes(model):
            layer = torch.nn.Linear(fan_in, fan_out, bias=False)
            x = torch.randn(rows, fan_in)
            quantized = int8_dynamic(torch.nn.Sequential(layer))
            bf16_x, bf16_w = x.bfloat16(), layer.weight.detach().bfloat16()
            totals["fp32"] += count * _seconds(lambda: layer(x))
            totals["bf16"] += count * _seconds(lambda: F.linear(bf16_x, bf16_w))
            totals["int8"] += count * _seconds(lambda: quantized(x))
    return totals


def _fake_int8_weights(model: torch.nn.Module) -> None:
    """Rounds every linear weight to int8 per output channel (symmetric), in place, kept in fp32."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                scale = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
                module.weight = torch.nn.Parameter(torch.round(w / scale).clamp(-127, 127) * scale)


def _int8_rows(module, args):
    """A linear layer's input rounded to 8 bits per row (asymmetric: each row's own min and max)."""
    x = args[0]
    low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((high - low) / 255).clamp_min(1e-12)
    zero = torch.round(-low / scale)
    return ((torch.round(x / scale) + zero).clamp(0, 255) - zero) * scale,


def variant_model(model: torch.nn.Module, variant: str) -> torch.nn.Module:
    """A copy of the fp32 `model` that computes as `variant` (one of VARIANTS) does."""
    if variant == "int8 dynamic (torch)":
        return int8_dynamic(model)
    out = copy.deepcopy(model)
    if variant == "bf16":
        return out.to(torch.bfloat16)
    _fake_int8_weights(out)
    if variant == "int8 W8A8 per row":
        for module in out.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(_int8_rows)
    return out


def sampled_sequences(model, tokenizer, config, prompts: int, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids `[n, T]` left-padded, attention mask, mask of the response tokens): the task's eval
    prompts with responses the fp32 model sampled at temperature 1."""
    from asyncrl.data.files import load_examples
    from asyncrl.data.tasks import encode_prompt

    examples = load_examples(config.task, "eval", prompts)[:prompts]
    encoded = [encode_prompt(e, tokenizer, config.model.use_chat_template, config.task.chat_template_kwargs)
               for e in examples]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(map(len, encoded))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in encoded])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in encoded])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad)
    response = torch.zeros_like(out, dtype=torch.bool)
    response[:, width:] = True
    return out, torch.cat([mask, torch.ones_like(out[:, width:])], 1), response


def distribution_shift(model, sequences) -> dict[str, dict[str, float]]:
    """Per variant: KL(fp32 || variant) per response token (mean, 99th percentile) and the mean and
    largest |change| of the sampled token's log-prob."""
    ids, attention, response = sequences
    target = ids[:, 1:]
    where = response[:, 1:]

    def logprobs(m):
        with torch.no_grad():
            return torch.log_softmax(m(input_ids=ids, attention_mask=attention).logits[:, :-1].float(), -1)

    reference = logprobs(model)
    out = {}
    for variant in VARIANTS:
        lp = logprobs(variant_model(model, variant))
        kl = (reference.exp() * (reference - lp)).sum(-1)[where]
        change = (lp - reference).gather(-1, target[..., None])[..., 0][where].abs()
        out[variant] = {"kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
                        "logprob_change_mean": change.mean().item(), "logprob_change_max": change.max().item()}
    return out


def measure(overrides: list[str], prompts: int, new_tokens: int) -> dict:
    from asyncrl.config import compose
    from asyncrl.models.loading import load_policy
    from asyncrl.models.precision import device_name

    torch.set_num_threads(1)  # as a generator runs (engine.threads)
    config = compose(overrides)
    model, tokenizer = load_policy(config.model)
    model = model.float().eval()
    speed = {rows: product_seconds(model, rows) for rows in ROWS}
    shift = distribution_shift(model, sampled_sequences(model, tokenizer, config, prompts, new_tokens))
    return {"cpu": device_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "speed": speed,
            "shift": shift, "prompts": prompts, "new_tokens": new_tokens}


def report(result: dict) -> str:
    lines = [f"{result['cpu']} ({result['cpu_capability']}), one thread",
             "", "| rows | fp32 ms | bf16 ms | int8 ms | bf16 / fp32 speed | int8 / fp32 speed |", "|---|---|---|---|---|---|"]
    for rows, s in result["speed"].items():
        lines.append(f"| {rows} | {s['fp32'] * 1e3:.1f} | {s['bf16'] * 1e3:.1f} | {s['int8'] * 1e3:.1f} | "
                     f"{s['fp32'] / s['bf16']:.2f}x | {s['fp32'] / s['int8']:.2f}x |")
    lines += ["", f"{result['prompts']} prompts x {result['new_tokens']} sampled tokens, against fp32:", "",
              "| variant | KL per token (mean) | KL p99 | mean abs log-prob change | largest |", "|---|---|---|---|---|"]
    for variant, s in result["shift"].items():
        lines.append(f"| {variant} | {s['kl_mean']:.5f} | {s['kl_p99']:.4f} | {s['logprob_change_mean']:.4f} | "
                     f"{s['logprob_change_max']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model=tiny task=tiny")
    args = parser.parse_args()
    print(report(measure(args.overrides, args.prompts, args.new_tokens)))


if __name__ == "__main__":
    main()
