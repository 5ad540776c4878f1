"""Does `torch.compile` pay for the embedded engine's decode step? (issue 31, `docs/benchmarks.md` 7b)

The engine's own forward (`asyncrl.engines.llama_decoder.LlamaDecoder.forward`, the function a window
calls for every token) on the embedded model in bfloat16, one thread: one decode token for a batch
of rows over a context, eager against `torch.compile` (dynamic shapes: the attended width grows by
one column a token), and compiled with inductor's weight freezing (constant-folded weights: a new
weight version would mean compiling again). Each variant decodes `--tokens` tokens after a prefill;
the figure is the median of the second half (the first three calls compile). Prints one table, all variants of one run side by side.

    python load_tests/engine_compile.py [--batches 1 16 64] [--context 128] [--tokens 24]

On 2 cores compiling the embedded model takes 2-4 minutes a batch size and variant: ~35 minutes in
all (`--batches 1` alone: ~5). `--model tiny` checks the script in seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def decode_seconds(decoder, forward, batch: int, context: int, tokens: int) -> tuple[float, float, torch.Tensor]:
    """(the first three decode calls' seconds: compiling, and compiling again once the width is
    seen to change; the median decode step of the second half; the last step's logits). The
    tokens are the same for every variant, so the logits compare."""
    block = decoder.new_block(batch, context + tokens)
    block.valid[:, :context] = True
    rows = slice(0, batch)
    generator = torch.Generator().manual_seed(0)
    vocab = min(decoder.model.config.vocab_size, 1000)
    times = []
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (batch, context), generator=generator)
        decoder.forward(prompt, torch.arange(context).expand(batch, context), block, rows, 0)
        for step in range(tokens):
            column = context + step
            block.valid[:, column] = True
            token = torch.randint(0, vocab, (batch, 1), generator=generator)
            start = time.perf_counter()
            logits = forward(token, torch.full((batch, 1), column), block, rows, column)
            times.append(time.perf_counter() - start)
    return sum(times[:3]), statistics.median(times[len(times) // 2:]), logits


def measure(model_preset: str, batches: list[int], context: int, tokens: int, variants: tuple[str, ...] = ()) -> dict:
    """{(variant, batch): (compiling s, decode step s, max |logit - eager logit|)}, for `variants`
    (eager first; by default all of VARIANTS)."""
    import torch._dynamo
    import torch._inductor.config as inductor

    from asyncrl.config import compose
    from asyncrl.engines.llama_decoder import LlamaDecoder
    from asyncrl.models.loading import load_policy

    torch.set_num_threads(1)  # as a generator runs (engine.threads)
    model, _ = load_policy(compose([f"model={model_preset}"]).model)
    decoder = LlamaDecoder(model.to(torch.bfloat16).eval())
    rows, eager_logits = {}, {}
    try:
        for variant in variants or VARIANTS:
            inductor.freezing = variant.endswith("weights")
            for batch in batches:
                torch._dynamo.reset()  # each batch compiles afresh (and within dynamo's recompile limit)
                forward = decoder.forward if variant == "eager" else torch.compile(decoder.forward, dynamic=True)
                first, step, logits = decode_seconds(decoder, forward, batch, context, tokens)
                eager_logits.setdefault(batch, logits)
                rows[variant, batch] = (first, step, float((logits - eager_logits[batch]).abs().max()))
                print(f"{variant}, batch {batch}: first three calls {first:.1f} s, decode step {step * 1e3:.1f} ms, "
                      f"logits within {rows[variant, batch][2]:.3g} of eager", flush=True)
    finally:
        inductor.freezing = False
        torch._dynamo.reset()
    return rows


def report(rows: dict, batches: list[int]) -> str:
    lines = ["| batch | eager ms/token step | compiled | compiled, frozen weights | first three calls (compiling): compiled, frozen |",
             "|---|---|---|---|---|"]
    for batch in batches:
        eager = rows["eager", batch][1]
        cells = [f"{rows[v, batch][1] * 1e3:.1f} ({eager / rows[v, batch][1]:.2f}x)" if (v, batch) in rows else "-"
                 for v in VARIANTS[1:]]
        firsts = [f"{rows[v, batch][0]:.1f} s" if (v, batch) in rows else "-" for v in VARIANTS[1:]]
        lines.append(f"| {batch} | {eager * 1e3:.1f} | {cells[0]} | {cells[1]} | {', '.join(firsts)} |")
    return "\n".join(lines)


VARIANTS = ("eager", "compiled", "compiled, frozen weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--model", default="smollm2-135m", help="model preset (model=...): the embedded default")
    args = parser.parse_args()
    if args.tokens < 8:
        parser.error("--tokens must be at least 8 (three calls compile; the median is over the second half)")
    rows = measure(args.model, args.batches, args.context, args.tokens)
    print()
    print(report(rows, args.batches))


if __name__ == "__main__":
    main()
