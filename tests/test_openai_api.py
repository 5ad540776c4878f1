"""The policy endpoint's request handling on a real tiny engine, without Serve (the application's
class called as its routes call it): stop strings in streams and plain answers, lengths, the
fields it honours or refuses by name, penalties and logit bias, content parts and roles, tool
choices, and the batcher that runs concurrent requests in shared engine windows. The same
endpoint behind Serve, with real clients: tests/test_policy_endpoint.py."""

import asyncio
import json
import threading

import pytest

from asyncrl.api.requests import ChatCompletionRequest, CompletionRequest, OpenAIError
from asyncrl.config import compose
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.batch_jobs import TooLarge
from asyncrl.engines.batching import WindowBatcher
from asyncrl.engines.generation import build_generator_engine, sequence_input
from asyncrl.messages.structs import FinishReason
from asyncrl.serve.policy import PolicyServer

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "the episode's digit",
                                           "parameters": {"type": "object", "properties": {}}}}]
# The tiny vocabulary's <pad>, <eos>, <bos>: a choice runs to its length, one character per token.
NO_EOS = {"0": -100, "1": -100, "2": -100}


def server_of(*overrides):
    """The `policy` application's class itself (Serve wraps it; its routes are its methods)."""
    config = compose(["model=tiny", "task=tiny_tool", "serve.follow_learner=false", *overrides])
    return PolicyServer.func_or_class.__bases__[0](config)


@pytest.fixture(scope="module")
def server():
    return server_of()


def call(coroutine):
    return asyncio.run(coroutine)


async def chat(server, **fields):
    response = await server.chat_completions(ChatCompletionRequest(**{"messages": [{"role": "user", "content": "5:"}],
                                                                      **fields}))
    if fields.get("stream"):
        return [json.loads(c[6:]) for c in [chunk async for chunk in response.body_iterator] if c != "data: [DONE]\n\n"]
    return json.loads(response.body)


async def completion(server, **fields):
    response = await server.completions(CompletionRequest(**fields))
    if fields.get("stream"):
        return [json.loads(c[6:]) for c in [chunk async for chunk in response.body_iterator] if c != "data: [DONE]\n\n"]
    return json.loads(response.body)


def test_a_stop_string_ends_a_stream_where_it_ends_a_plain_answer_and_none_of_it_is_streamed(server):
    async def main():
        for seed in range(200):  # a sample with a two-character stretch first seen after its start
            full = await completion(server, prompt="2:3", max_tokens=12, seed=seed, logit_bias=NO_EOS, logprobs=0)
            text = full["choices"][0]["text"]
            cut = next((i for i in range(1, len(text) - 3) if text[i:i + 2] not in text[:i + 1]), None)
            if cut is not None:
                break
        stop = text[cut:cut + 2]  # two tokens: the stream must hold the first back until it knows
        plain = await completion(server, prompt="2:3", max_tokens=12, seed=seed, logit_bias=NO_EOS, logprobs=0, stop=stop)
        chunks = await completion(server, prompt="2:3", max_tokens=12, seed=seed, logit_bias=NO_EOS, logprobs=0,
                                  stop=stop, stream=True)
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        choice = plain["choices"][0]
        assert choice["text"] == streamed == text[:cut] and choice["finish_reason"] == "stop"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        # The tokens up to the one that completes the stop string, no further, in both.
        assert plain["usage"]["completion_tokens"] == cut + 2 == len(choice["logprobs"]["tokens"])
        assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == cut + 2
        assert choice["logprobs"]["token_logprobs"] == full["choices"][0]["logprobs"]["token_logprobs"][:cut + 2]

    call(main())


def test_lengths_max_completion_tokens_and_the_default(server):
    async def main():
        asked = await chat(server, max_completion_tokens=40, logit_bias=NO_EOS)
        assert asked["usage"]["completion_tokens"] == 40 and asked["choices"][0]["finish_reason"] == "length"
        older = await chat(server, max_tokens=7, logit_bias=NO_EOS)
        assert older["usage"]["completion_tokens"] == 7
        # Chat with no length: what is left of the context (128 positions, a 2-token prompt).
        default = await chat(server, logit_bias=NO_EOS)
        assert default["usage"]["completion_tokens"] == 126
        capped = await chat(server_of("serve.max_response_tokens=50"), logit_bias=NO_EOS)
        assert capped["usage"]["completion_tokens"] == 50
        # Legacy completions keep OpenAI's default of 16.
        assert (await completion(server, prompt="5:", logit_bias=NO_EOS))["usage"]["completion_tokens"] == 16
        for fields, param in [({"max_completion_tokens": 5, "max_tokens": 6}, "max_completion_tokens"),
                              ({"max_completion_tokens": 5000}, "max_completion_tokens"),
                              ({"max_tokens": 127}, "max_tokens")]:
            with pytest.raises(OpenAIError) as refused:
                await chat(server, **fields)
            assert refused.value.status == 400 and refused.value.param == param, refused.value.message

    call(main())


def test_every_field_is_honoured_or_refused_by_name(server):
    async def main():
        for fields, param in [({"response_format": {"type": "json_object"}}, "response_format"),
                              ({"store": True}, "store"), ({"reasoning_effort": "high"}, "reasoning_effort"),
                              ({"audio": {"voice": "alloy"}}, "audio"), ({"typical_p": 0.5}, "typical_p"),
                              ({"functions": [{"name": "f"}]}, "functions"), ({"service_tier": "flex"}, "service_tier"),
                              ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"tool_choice": "required"}, "tool_choice"),
                              ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                               "tool_choice")]:
            with pytest.raises(OpenAIError) as refused:
                await chat(server, max_tokens=2, **fields)
            assert refused.value.status == 400 and refused.value.param == param, (fields, refused.value.message)
        # What changes nothing in the answer is accepted, and so are the defaults of the refused fields.
        ok = await chat(server, max_tokens=2, user="u", parallel_tool_calls=False, store=False, service_tier="auto",
                        response_format={"type": "text"}, prompt_cache_key="k", metadata=None, seed=3)
        assert ok["choices"][0]["finish_reason"] in ("stop", "length")
        with pytest.raises(OpenAIError, match="echo"):
            await completion(server, prompt="5:", echo=True)

    call(main())


def test_vllms_top_k_and_min_p_are_honoured(server):
    """Sent as vLLM's clients send them (`extra_body`): top_k=1, or min_p=1, leaves only the most
    likely token, so a hot temperature answers what greedy decoding answers; -1 is vLLM's off."""
    async def main():
        greedy = await chat(server, max_tokens=12, temperature=0.0)
        for fields in ({"top_k": 1}, {"min_p": 1.0}):
            hot = await chat(server, max_tokens=12, temperature=1.5, seed=5, **fields)
            assert hot["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"], fields
        off = await chat(server, max_tokens=12, temperature=1.0, seed=5, top_k=-1)
        plain = await chat(server, max_tokens=12, temperature=1.0, seed=5)
        assert off["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]

    call(main())


def test_penalties_and_logit_bias_are_honoured(server):
    async def main():
        # Greedy, the random tiny policy repeats itself; a presence penalty of 2 forbids it in practice.
        plain = await chat(server, temperature=0, max_tokens=20, logit_bias=NO_EOS, logprobs=True)
        penalised = await chat(server, temperature=0, max_tokens=20, logit_bias=NO_EOS, presence_penalty=2.0,
                               logprobs=True)
        tokens = [e["token"] for e in plain["choices"][0]["logprobs"]["content"]]
        distinct = [e["token"] for e in penalised["choices"][0]["logprobs"]["content"]]
        assert len(set(tokens)) < len(tokens) and len(set(distinct)) == len(distinct) == 20
        # A bias of +100 on one token: every sample is it, with a log-prob of ~0 (the adjusted distribution).
        forced = await chat(server, max_tokens=5, logit_bias={"5": 100}, logprobs=True, seed=1)
        entries = forced["choices"][0]["logprobs"]["content"]
        assert forced["choices"][0]["message"]["content"] == "22222" and all(e["logprob"] > -1e-3 for e in entries)

    call(main())


def test_developer_role_and_content_parts_read_as_system_and_text(server):
    async def main():
        as_text = await chat(server, messages=[{"role": "system", "content": "1"}, {"role": "user", "content": "5:"}],
                             max_tokens=4, seed=9, logprobs=True)
        as_parts = await chat(server, messages=[{"role": "developer", "content": [{"type": "text", "text": "1"}]},
                                                {"role": "user", "content": [{"type": "text", "text": "5"},
                                                                              {"type": "text", "text": ":"}]}],
                              max_tokens=4, seed=9, logprobs=True)
        assert as_parts["choices"] == as_text["choices"] and as_parts["usage"] == as_text["usage"]

    call(main())
    # An image part is read where the model takes images (tests/test_policy_images.py); this one does not.
    with pytest.raises(OpenAIError, match="the model tiny is a text-only model"):
        call(chat(server, max_tokens=2, messages=[{"role": "user", "content": [{"type": "image_url",
                                                                               "image_url": {"url": "x"}}]}]))


def test_tool_choice_auto_none_required_and_named_and_streamed_tool_calls(server):
    """The tiny format: a turn that starts with a non-digit is a call of the lookup tool."""
    async def main():
        kinds = {(await chat(server, tools=TOOLS, max_tokens=3, seed=s))["choices"][0]["finish_reason"]
                 for s in range(12)}
        assert kinds == {"tool_calls", "stop", "length"} or "tool_calls" in kinds and len(kinds) > 1
        for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
            reply = await chat(server, tools=TOOLS, tool_choice=choice, max_tokens=3, seed=1)
            (made,) = reply["choices"][0]["message"]["tool_calls"]
            assert reply["choices"][0]["finish_reason"] == "tool_calls" and made["function"]["name"] == "lookup"
            assert reply["choices"][0]["message"]["content"] is None
        for seed in range(12):  # none: never a call, whatever the first character
            reply = await chat(server, tools=TOOLS, tool_choice="none", max_tokens=3, seed=seed)
            assert "tool_calls" not in reply["choices"][0]["message"]
        chunks = await chat(server, tools=TOOLS, tool_choice="required", max_tokens=3, stream=True)
        deltas = [c["choices"][0] for c in chunks]
        assert deltas[0]["delta"]["role"] == "assistant"
        (streamed,) = [d["delta"]["tool_calls"] for d in deltas if d["delta"].get("tool_calls")]
        assert streamed[0]["index"] == 0 and streamed[0]["function"] == {"name": "lookup", "arguments": "{}"}
        assert deltas[-1]["finish_reason"] == "tool_calls"

    call(main())


def test_concurrent_requests_share_engine_windows_and_get_the_samples_they_get_alone():
    engine, _ = build_generator_engine(compose(["model=tiny"]).model, compose(["model=tiny"]).engine)
    batcher = WindowBatcher(engine, max_rows=64, window_tokens=8, max_positions=1 << 20)
    hot, cold = SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)

    async def job(seed, params, max_tokens=30, n=2, leave_after=None):
        steps = batcher.stream([sequence_input([5, 6, 7], seed * 10 + k, max_tokens) for k in range(n)], params)
        tokens = {}
        try:
            async for batch in steps:
                for s in batch:
                    tokens.setdefault(s.row, []).append(s.token)
                if leave_after is not None and sum(map(len, tokens.values())) >= leave_after:
                    break
        finally:
            steps.close()
        return tokens

    async def main():
        alone = [await job(s, hot if s % 2 else cold) for s in range(6)]
        windows = batcher.counters["windows"]
        endless = SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0), (2, -100.0)))
        together = await asyncio.gather(*(job(s, hot if s % 2 else cold) for s in range(6)),
                                        job(99, endless, max_tokens=120, leave_after=20))  # one leaves early
        assert list(together[:6]) == alone  # settings differ, windows are shared; samples are the same
        assert batcher.counters["windows"] - windows < sum(
            -(-len(t) // 8) for a in alone for t in a.values())  # fewer windows than rows run alone
        await asyncio.sleep(0.2)
        assert batcher.stats()["running_sequences"] == 0 and batcher.counters["jobs_left"] == 1

    asyncio.run(main())


def test_clients_back_a_few_milliseconds_apart_share_one_window_when_the_batcher_gathers():
    """Four closed-loop clients: their answers end with one window and their next requests arrive
    5 ms apart. Started at once (gather 0) the next window holds the first request alone and the
    others wait for it; gathering (up to 0.5 s, ended as soon as the 4 rows are back) they share
    one window."""
    engine, _ = build_generator_engine(compose(["model=tiny"]).model, compose(["model=tiny"]).engine)
    params = SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0), (2, -100.0)))  # no EOS

    async def answer(batcher, seed):
        steps = batcher.stream([sequence_input([5, 6, 7], seed, 8)], params, live=False)
        try:
            return [s.token async for batch in steps for s in batch]
        finally:
            steps.close()

    async def rounds(gather_s):
        batcher = WindowBatcher(engine, max_rows=64, window_tokens=8, max_positions=1 << 20, gather_s=gather_s)
        first = await asyncio.gather(*(answer(batcher, seed) for seed in range(4)))  # one window of 4 rows

        async def returning(seed):
            await asyncio.sleep(0.005 * seed)
            return await answer(batcher, 10 + seed)

        second = await asyncio.gather(*(returning(seed) for seed in range(4)))
        assert all(len(tokens) == 8 for tokens in first + second)
        await asyncio.sleep(0.2)  # answers are handed over on their last step, before their window's end
        return batcher.counters["windows"], batcher.counters["window_rows"]

    assert asyncio.run(rounds(0.5)) == (2, 8)
    windows, rows = asyncio.run(rounds(0.0))
    assert windows >= 3 and rows == 8  # the first request back ran alone


def padded_path_engine():
    """An engine on transformers' padded path: a family the engine's own decoder does not know
    (Mistral), tiny and random; its EOS is token 0."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from asyncrl.engines.torch_engine import TorchEngine

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=None))
    engine = TorchEngine(model.eval(), (0,))
    assert not engine.keeps_caches
    return engine


@pytest.mark.parametrize(("cut_after_s", "short_streams", "padded"),
                         [(0.0, True, False), (0.0, False, False), (None, True, False), (0.0, True, True)])
def test_a_request_arriving_mid_window_joins_at_the_next_step_and_changes_no_sample(cut_after_s, short_streams, padded):
    """A long answer runs in a 64-token window; a short streamed request arriving as it starts cuts
    that window at its next decode step (`cut_after_s=0`) and has all its 8 tokens before the long
    one has 32 (streamed or not: a whole answer is handed over on its last step, not at its window's
    end); never cut (None) it waits for the whole window (64). Either way the long answer goes on
    from its kept KV cache and samples what it samples alone. On transformers' padded path, which
    keeps no caches and would re-read every context after a cut, windows are never cut."""
    if padded:
        engine = padded_path_engine()
    else:
        engine, _ = build_generator_engine(compose(["model=tiny"]).model, compose(["model=tiny"]).engine)
    params = SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0), (2, -100.0)))  # no EOS

    async def answer(batcher, seed, max_tokens, tokens, live=True):
        steps = batcher.stream([sequence_input([5, 6, 7], seed, max_tokens)], params, live=live)
        try:
            async for batch in steps:
                tokens += [s.token for s in batch]
        finally:
            steps.close()
        return tokens

    async def main():
        alone = await answer(WindowBatcher(engine, max_rows=64, window_tokens=64, max_positions=1 << 20), 1, 100, [])
        batcher = WindowBatcher(engine, max_rows=64, window_tokens=64, max_positions=1 << 20,
                                cut_after_s=cut_after_s)
        long_tokens: list[int] = []
        long = asyncio.create_task(answer(batcher, 1, 100, long_tokens))
        while not batcher.stats()["running_requests"]:  # its window has started
            await asyncio.sleep(0)
        short = await answer(batcher, 2, 8, [], live=short_streams)
        return alone, len(long_tokens), await long, short, batcher.counters

    reused = engine.kept.stats["reused"]
    alone, long_when_short_ended, long, short, counters = asyncio.run(main())
    assert len(short) == 8 and long == alone and len(long) == 100
    if cut_after_s is not None and not padded:
        assert long_when_short_ended < 32 and counters["windows_cut"] >= 1
    else:
        assert long_when_short_ended >= 64 and counters["windows_cut"] == 0
    if not padded:
        assert engine.kept.stats["reused"] > reused  # the long answer's next windows went on from kept caches


def test_a_whole_answer_gets_a_windows_steps_at_once_and_the_same_tokens_as_a_stream():
    """A job that does not stream wakes its reader once per window (8 tokens), not once per token,
    and samples exactly what the streamed job with the same seeds samples: the same tokens, log-probs,
    most likely tokens (cut to the job's `top_logprobs`) and finish on the last one."""
    engine, _ = build_generator_engine(compose(["model=tiny"]).model, compose(["model=tiny"]).engine)
    batcher = WindowBatcher(engine, max_rows=64, window_tokens=8, max_positions=1 << 20)
    params = SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0), (2, -100.0)),  # no EOS
                            top_logprobs=2)

    async def job(live):
        steps = batcher.stream([sequence_input([5, 6, 7], 40 + k, 30) for k in range(3)], params, live)
        reads, tokens = 0, {}
        try:
            async for batch in steps:
                reads += 1
                for s in batch:
                    tokens.setdefault(s.row, []).append((s.token, s.logprob, s.top, s.finish))
        finally:
            steps.close()
        return reads, tokens

    async def main():
        alone = await job(True), await job(False)
        return alone, await asyncio.gather(job(True), job(False))  # together: one window, read both ways

    ((live_reads, streamed), (window_reads, whole)), shared = asyncio.run(main())
    assert whole == streamed and all(len(t) == 30 for t in whole.values())
    steps = [step for row in whole.values() for step in row]
    assert all(len(top[0]) == len(top[1]) == 2 for _, _, top, _ in steps)
    finishes = [finish for *_, finish in steps]  # one per row, on its 30th token
    assert finishes.count(FinishReason.MAX_LENGTH) == 3 and finishes[29::30] == [FinishReason.MAX_LENGTH] * 3
    assert window_reads == 4 and live_reads > 4  # 30 tokens: windows of 8, 8, 8 and 6
    (shared_live_reads, shared_streamed), (shared_window_reads, shared_whole) = shared
    # In one window of 6 rows a row's log-probs may differ in the last bit with its place in the
    # batch (the matrix products block rows; seen once in a few runs): tokens and finishes exactly,
    # log-probs to 1e-5.
    def tokens(job):
        return {row: [(t[0], t[3]) for t in steps] for row, steps in job.items()}

    assert tokens(shared_whole) == tokens(shared_streamed) == tokens(whole)
    assert all(abs(a[1] - b[1]) < 1e-5 for row in shared_whole for a, b in zip(shared_whole[row], shared_streamed[row]))
    assert shared_window_reads <= 4 < shared_live_reads


def test_the_kv_block_a_window_allocates_stays_within_the_bound():
    """Rows with a long kept cache and new rows with a long prompt in one window would need their sum
    as its width (about twice what each row needs): the batcher admits only what fits the bound."""
    config = compose(["model=tiny", "model.max_positions=512"])
    engine, _ = build_generator_engine(config.model, config.engine)
    bound = 3000
    batcher = WindowBatcher(engine, max_rows=64, window_tokens=16, max_positions=bound)
    with pytest.raises(TooLarge):
        batcher.check([sequence_input([5] * 100, 0, 100)] * 20)  # 20 x 215 positions alone

    async def job(prompt_len, seed, delay):
        await asyncio.sleep(delay)
        steps = batcher.stream([sequence_input([5] * prompt_len, seed, 60)], SamplingParams())
        try:
            return sum([len(batch) async for batch in steps])
        finally:
            steps.close()

    async def main():
        # Short prompts running long, then long prompts joining while they run.
        return await asyncio.gather(*[job(4, s, 0.0) for s in range(8)], *[job(300, s, 0.05) for s in range(8)])

    produced = asyncio.run(main())
    assert all(n >= 1 for n in produced)
    assert 0 < engine.largest_block_positions <= bound


def test_detokenising_and_building_answers_run_off_the_event_loop():
    """64 greedy choices of 200 tokens (the tiny policy never ends a greedy answer) with 5 alternatives
    each: some 75,000 detokenisations, and a body of megabytes. None of it runs on the event loop
    that serves every other request (before: all of it did, and the loop paused for seconds)."""
    heavy = server_of("model.max_positions=512")
    decode, where = heavy.tokenizer.decode, {"loop": None, "on_loop": 0, "calls": 0}

    def watched(*args, **kwargs):  # the real tokenizer's decode, counted by thread
        where["calls"] += 1
        where["on_loop"] += threading.get_ident() == where["loop"]
        return decode(*args, **kwargs)

    heavy.tokenizer.decode = watched

    async def main():
        where["loop"] = threading.get_ident()
        response = await heavy.completions(CompletionRequest(prompt=["1:", "2:", "3:", "4:"], n=16, max_tokens=200,
                                                             logprobs=5, temperature=0, stop=["=+=", "j-j"]))
        return json.loads(response.body)

    answer = asyncio.run(main())
    assert len(answer["choices"]) == 64 and answer["usage"]["completion_tokens"] > 10_000
    assert where["calls"] > 50_000 and where["on_loop"] == 0, where


def test_a_model_with_qwen25s_template_is_prompted_through_it(smol_tokenizer, tmp_path):
    """A tiny random Llama over SmolLM2's vocabulary whose tokenizer carries Qwen2.5's chat template
    (`model.source=hf`): the endpoint's prompt for a conversation with tools and an earlier call is
    the template's own rendering, token for token (its tools section, the call, the tool turn)."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from chat_templates import QWEN25

    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = QWEN25
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    server = server_of("model.source=hf", f"model.path={tmp_path}", "model.name=qwen-tiny",
                       "model.use_chat_template=true", "environment.tool_format=chatml")
    messages = [{"role": "user", "content": "What is 6 * 7?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    reply = call(chat(server, messages=messages, tools=TOOLS, max_completion_tokens=2))
    rendered = [{**m, "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]}
                if m.get("tool_calls") else m for m in messages]
    expected = tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert reply["usage"]["prompt_tokens"] == len(expected) and reply["usage"]["completion_tokens"] <= 2
    forced = call(chat(server, messages=messages[:1], tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "lookup"}}, max_completion_tokens=1))
    start = tokenizer.encode('<tool_call>\n{"name": "lookup", "arguments": ', add_special_tokens=False)
    prompt = tokenizer.apply_chat_template(messages[:1], tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    # The call's start is written for the model: the answer's tokens, not the prompt's.
    assert forced["usage"]["prompt_tokens"] == len(prompt)
    assert forced["usage"]["completion_tokens"] == len(start) + 1


def test_the_models_configured_template_and_the_tasks_template_options_render_the_endpoints_prompt(tmp_path):
    """`model.chat_template` (a file) on a model without a template of its own, and
    `task.chat_template_kwargs`: the endpoint renders every piece through them (the prompt with its
    tools, the tool turn and the next generation prompt, as Qwen3's `enable_thinking=false` writes an
    empty thought after each), and its prompt is the one training's episodes start from."""
    from asyncrl.environments.tools import tool_specs
    from asyncrl.serve.policy_requests import chat_prompt
    from asyncrl.data.tasks import Example, encode_prompt

    # In the tiny alphabet: the tools' names and ":", the turns' text, "=" as the generation prompt,
    # "##" after it when thinking is off.
    (tmp_path / "think.jinja").write_text(
        "{% if tools %}{% for t in tools %}{{ t['function']['name'] }}{% endfor %}:{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}={% if enable_thinking is defined and not enable_thinking %}##{% endif %}{% endif %}")
    template = ["model.use_chat_template=true", f"model.chat_template={tmp_path}/think.jinja"]
    server = server_of(*template, "task.chat_template_kwargs={enable_thinking: false}")
    dig = [{"type": "function", "function": {"name": "dig", "parameters": {"type": "object", "properties": {}}}}]

    def prompt(server, messages, tools=None):
        request = ChatCompletionRequest(messages=messages, **({"tools": tools} if tools else {}))
        return server.tokenizer.decode(chat_prompt(server, request)[0])

    assert prompt(server, [{"role": "user", "content": "3:"}]) == "3:=##"
    assert prompt(server_of(*template), [{"role": "user", "content": "3:"}]) == "3:="
    episode = prompt(server, [{"role": "user", "content": "3:"},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"id": "c1", "type": "function", "function": {"name": "dig", "arguments": "{}"}}]},
                              {"role": "tool", "tool_call_id": "c1", "content": "7"}], dig)
    assert episode.startswith("dig:3:=##") and episode.endswith("7=##")
    reply = call(chat(server, max_completion_tokens=1))
    assert reply["usage"]["prompt_tokens"] == len("3:=##")
    # Training's prompt for the same conversation, with the task's tools, is the endpoint's.
    example = Example("p0", [{"role": "user", "content": "3:"}], "7", "tiny_tool")
    trained = encode_prompt(example, server.tokenizer, True, server.config.task.chat_template_kwargs,
                            server.config.environment)
    assert trained == chat_prompt(server, ChatCompletionRequest(messages=example.messages,
                                                                tools=tool_specs(server.config.environment)))[0]


def test_a_request_gets_the_weight_version_it_asks_for_or_a_409():
    """`weight_version` (exact) and `min_weight_version`: answered from those weights, waited for
    while a newer version is on its way (up to `serve.version_wait_s`), else 409 naming the version held."""
    server = server_of("serve.version_wait_s=1.0")
    held = server.policy.weight_version
    named = list(server.policy.engine.model.named_parameters())

    async def main():
        exact = await chat(server, max_tokens=3, weight_version=held)
        assert exact["weight_version"] == held
        for fields, param in (({"weight_version": held + 5}, "weight_version"),
                              ({"min_weight_version": held + 5}, "min_weight_version")):
            with pytest.raises(OpenAIError) as refused:
                await chat(server, max_tokens=3, **fields)
            assert refused.value.status == 409 and refused.value.param == param, refused.value.message
            assert f"serves version {held}" in refused.value.message

        async def land_later():
            await asyncio.sleep(0.3)
            await server.policy.load(named, held + 2)

        later = asyncio.ensure_future(land_later())
        waited = await chat(server, max_tokens=3, min_weight_version=held + 2)  # waits for it, then answers
        await later
        assert waited["weight_version"] == held + 2
        with pytest.raises(OpenAIError, match="a newer one replaced it") as old:
            await chat(server, max_tokens=3, weight_version=held)
        assert old.value.status == 409

    call(main())
