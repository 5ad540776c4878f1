"""The policy endpoint's sampling functions on a real tiny engine (no Serve): a plain call and a
stream of the same seed end at a stop string alike, text, tokens, log-probs and usage."""

import asyncio

from asyncrl.config import compose
from asyncrl.generation import build_engine
from asyncrl.openai_api import CompletionRequest, generate_choices, stream_choices


def test_a_stop_string_ends_a_plain_call_where_it_ends_a_stream():
    engine, tokenizer = build_engine(compose(["model=tiny"]).model)
    prompt = [tokenizer.encode("2:3")]

    async def plain(**fields):
        return (await generate_choices(engine, tokenizer, prompt, CompletionRequest(prompt="2:3", **fields)))[0]

    async def streamed(**fields):
        deltas = [d async for d in stream_choices(engine, tokenizer, prompt, CompletionRequest(prompt="2:3", **fields))]
        return "".join(d.text for d in deltas), [t for d in deltas for t in d.tokens], [lp for d in deltas for lp in d.logprobs]

    async def main():
        for seed in range(100):  # a sample with a character first seen after its start (the stop), and 2 more
            full = await plain(max_tokens=12, seed=seed)
            cut_at = next((i for i in range(1, len(full["text"]) - 2) if full["text"][i] not in full["text"][:i]), None)
            if cut_at is not None:
                break
        assert cut_at is not None
        stop = full["text"][cut_at]
        cut = await plain(max_tokens=12, seed=seed, stop=stop)
        text, tokens, logprobs = await streamed(max_tokens=12, seed=seed, stop=stop)
        assert cut["text"] == text == full["text"][:cut_at] and cut["finish_reason"] == "stop"
        # The tokens up to the one that completes the stop string, no further.
        n = len(tokens)
        assert cut["completion_tokens"] == n < full["completion_tokens"]
        assert tokenizer.decode(tokens, skip_special_tokens=True).endswith(stop)
        assert not tokenizer.decode(tokens[:-1], skip_special_tokens=True).endswith(stop)
        assert cut["token_logprobs"] == logprobs == full["token_logprobs"][:n]
        # Overlapping stops: one that starts earlier but completes later loses to the one completed first.
        stops = [full["text"][cut_at - 1:cut_at + 2], stop]
        both = await plain(max_tokens=12, seed=seed, stop=stops)
        assert both["text"] == (await streamed(max_tokens=12, seed=seed, stop=stops))[0] == full["text"][:cut_at]
        assert both["completion_tokens"] == n

    asyncio.run(main())
