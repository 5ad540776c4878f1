"""What the real-engine tests share (tests/test_sglang_real.py, tests/test_vllm_real.py): the
prompts, the learner's side of every check (`asyncrl.learning.scoring.response_logprobs`, the
function the learner scores with, under the weights of the version each token was given), loading
a version from a worker thread as a generator does, and the checks whose rule is the same on both
engines. Each module starts its own engine on its own loop and passes it in."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import sequence_input
from asyncrl.learning.scoring import LOGPROB_FLOOR, response_logprobs
from asyncrl.messages.structs import FinishReason
from asyncrl.models.loading import build_tiny_tokenizer
from asyncrl.weights.shared_memory import SharedSlots
from tiny_hf_models import perturbed, tiny_qwen2

# float32 on both sides: the engines' CPU kernels and the learner's forward agree to ~1e-6.
TOLERANCE = 1e-4
EOS = build_tiny_tokenizer().eos_token_id
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20, 21], [22, 23, 24, 25, 26, 27]]


@pytest.fixture(scope="module")
def loop():
    """The loop the module's engine is built on and runs on, as a generator actor's."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def models(tiny):
    """Weight version -> the model the engine holds at that version (the learner's side of each
    check); `tiny` is the module's fixture."""
    return {0: tiny[1]}


def started(loop, start):
    """The engine `start()` builds, built on the loop that runs it, as in a generator actor."""
    async def build():
        return start()

    return loop.run_until_complete(build())


def saved_tiny(tmp_path_factory, **shape):
    """The tiny model and the Hugging Face directory an engine loads it from."""
    model, tokenizer = tiny_qwen2(**shape)
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory), model


def generate(loop, engine, sequences, window_tokens, params):
    return loop.run_until_complete(engine.generate_window(sequences, window_tokens, params))


def learner_logprobs(model, context, new, temperature, top_k=0, top_p=1.0) -> np.ndarray:
    return response_logprobs(model, [(np.asarray(context), np.asarray(new))], temperature, top_k, top_p)[0]


def check_against_learner(models, context, out, temperature, top_k=0, top_p=1.0):
    """Every token's log-prob against the learner's under the weights of the version it was given."""
    for version in np.unique(out.versions):
        learner = learner_logprobs(models[int(version)], context, out.token_ids, temperature, top_k, top_p)
        mine = out.versions == version
        np.testing.assert_allclose(out.logprobs[mine], learner[mine], atol=TOLERANCE, rtol=0)


class Tokens:
    """Tokens, log-probs and versions read elsewhere (a segment, a stream) as a window's output."""

    def __init__(self, token_ids, logprobs, versions):
        self.token_ids, self.logprobs, self.versions = token_ids, logprobs, versions


def load(loop, engine, models, model, how: str) -> int:
    """Give the engine `model` as the next version, from a worker thread (as the generator does)."""
    version = engine.weight_version + 1
    models[version] = model
    loop.run_until_complete(asyncio.to_thread(load_in_thread, engine, model, version, how))
    return version


def load_in_thread(engine, model, version, how):
    if how == "tensors":
        engine.update_weights(list(model.named_parameters()), version)
    else:
        slots = SharedSlots()
        try:
            engine.adopt_shared(slots.write(model.named_parameters()), version)
        finally:
            slots.close()


def deliver_over_shared_memory(loop, engine, delivery, named_tensors):
    """`delivery` with its tensors through a shared-memory slot, taken by the generator's own
    `asyncrl.weights.transport.load` on a worker thread."""
    from asyncrl.weights import transport

    slots = SharedSlots()
    try:
        loop.run_until_complete(asyncio.to_thread(transport.load, engine, delivery, slots.write(named_tensors), None))
    finally:
        slots.close()


# --- the checks both engines pass ------------------------------------------------------------------


def check_windows_carry_the_learners_logprobs(loop, engine, models):
    sequences = [sequence_input(p, seed=i, max_response_tokens=64) for i, p in enumerate(PROMPTS)]
    outputs = generate(loop, engine, sequences, 24, SamplingParams(temperature=1.0))
    for prompt, out in zip(PROMPTS, outputs):
        assert (out.versions == engine.weight_version).all()
        check_against_learner(models, prompt, out, 1.0)
        ended = out.finish_reason is FinishReason.EOS
        assert ended == (out.token_ids[-1] == EOS) and (ended or len(out.token_ids) == 24)
        assert out.finish_reason in (FinishReason.EOS, FinishReason.WINDOW)


def check_top_k_top_p_logprobs_are_the_truncated_distributions(loop, engine, models):
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    sequences = [sequence_input(p, seed=10 + i, max_response_tokens=32) for i, p in enumerate(PROMPTS)]
    gaps = []
    for prompt, out in zip(PROMPTS, generate(loop, engine, sequences, 32, params)):
        model = models[engine.weight_version]
        truncated = learner_logprobs(model, prompt, out.token_ids, 0.8, top_k=5, top_p=0.9)
        assert (truncated > LOGPROB_FLOOR).all(), "a token outside the top-k / top-p set was drawn"
        check_against_learner(models, prompt, out, 0.8, top_k=5, top_p=0.9)
        gaps += list(out.logprobs - learner_logprobs(model, prompt, out.token_ids, 0.8))
    # Renormalised after the cut, each is above the plain softmax(logits / T) log-prob.
    assert np.median(gaps) > 0.05


def check_greedy_windows_take_the_learners_argmax(loop, engine, models):
    import torch

    outputs = generate(loop, engine, [sequence_input(p, seed=0, max_response_tokens=12) for p in PROMPTS], 12,
                       SamplingParams(greedy=True))
    model = models[engine.weight_version]
    for prompt, out in zip(PROMPTS, outputs):
        with torch.no_grad():
            best = model(torch.tensor([prompt + out.token_ids.tolist()])).logits[0, len(prompt) - 1:-1].argmax(-1)
        assert out.token_ids.tolist() == best.tolist()
        check_against_learner(models, prompt, out, 1.0)


def check_an_update_mid_request_lands_at_once(loop, engine, models):
    """Shared-memory path. The update is applied while a long window runs; its requests are cut and
    continue under the new weights with nothing read from the cache of the old ones. Twelve prompts
    that share no prefix: a continued request may read from the cache only what another continued
    request computed under the new weights, and with no shared prefix there is none of that either,
    so any cached token it reads would be one computed under the old weights."""
    params = SamplingParams(temperature=1.0)
    sequences = [sequence_input([3 + i] + PROMPTS[i % len(PROMPTS)], seed=60 + i, max_response_tokens=232)
                 for i in range(12)]
    start = time.perf_counter()
    warm = generate(loop, engine, sequences, 32, params)
    per_token = (time.perf_counter() - start) / 32
    continued = [sequence_input(s.prompt_ids, seed=s.seed, max_response_tokens=232, response_ids=o.token_ids)
                 for s, o in zip(sequences, warm) if not o.finished]
    before = dict(engine.counters)
    old = engine.weight_version
    new_model = perturbed(models[old], seed=old + 1)

    async def window_with_update():
        window = asyncio.ensure_future(engine.generate_window(continued, 200, params))
        await asyncio.sleep(60 * per_token)  # about 60 tokens into the window
        version = engine.weight_version + 1
        models[version] = new_model
        await asyncio.to_thread(load_in_thread, engine, new_model, version, "shared")
        assert not window.done(), "the update waited for the window to end"
        return version, await window

    new, outputs = loop.run_until_complete(window_with_update())
    spanning = 0
    for sequence, out in zip(continued, outputs):
        assert set(np.unique(out.versions)) <= {old, new} and (np.diff(out.versions) >= 0).all()
        spanning += len(np.unique(out.versions)) == 2
        check_against_learner(models, np.concatenate([sequence.prompt_ids, sequence.response_ids]), out, 1.0)
    assert spanning, "no sequence ran across the update"
    assert engine.counters["continued"] - before["continued"] >= spanning
    assert engine.counters["continued_cached_tokens"] == before["continued_cached_tokens"]


def check_the_generator_role_loads_versions_before_and_while_it_runs(loop, engine, models, from_start: bool = False):
    """`actors.generator.Generator` on the engine, as a generator actor runs it: a version delivered
    before its loop starts (joining the pool) loads at once; one delivered while it runs lands
    mid-window (`updates_mid_window`). Every token's recorded version is exact: its log-prob is the
    learner's under those weights. Returns the generator and the seconds the second update paused it.
    Each version is one perturbation of the one before, or (`from_start`) of the starting weights: a
    chain of them made vLLM's tiny model end every sample in its first window."""
    from actors.generator import Generator
    from asyncrl.messages.mailbox import InProcessMailbox
    from asyncrl.messages.structs import PromptRequest, int32_array
    from asyncrl.weights.sync import Delivery

    prompts, segments = InProcessMailbox(100, lease_s=600), InProcessMailbox(10_000, lease_s=600)
    generator = Generator(engine, prompts, segments, SamplingParams(temperature=1.0), window_tokens=48,
                          max_response_tokens=192, max_windows=0, max_inflight=8)
    slots = SharedSlots()

    async def deliver(model, version):
        models[version] = model
        return await generator.receive_weights(Delivery(version, "shm"), slots.write(model.named_parameters()))

    async def scenario():
        first = engine.weight_version + 1
        await deliver(perturbed(models[0 if from_start else engine.weight_version], seed=first), first)  # loads now
        assert engine.weight_version == first
        await prompts.put([PromptRequest(prompt_id=f"g{i}", prompt_token_ids=int32_array(p), group_size=2, seed=90 + i)
                           for i, p in enumerate(PROMPTS[:4])])
        running = asyncio.ensure_future(generator.run())
        while generator.counters["tokens"] == 0:
            await asyncio.sleep(0.05)
        paused = await deliver(perturbed(models[0 if from_start else first], seed=first + 1), first + 1)  # mid-window
        while generator.counters["samples_finished"] < 8:
            await asyncio.sleep(0.1)
        generator.stop()
        await running
        return first, paused

    try:
        first, paused = loop.run_until_complete(scenario())
    finally:
        slots.close()
    versions = set()
    for segment in loop.run_until_complete(segments.get(10_000, timeout=0.1)):
        assert len(segment.new_versions) == len(segment.new_token_ids)
        versions |= set(segment.new_versions.tolist())
        check_against_learner(models, np.concatenate([segment.prompt_token_ids, segment.prior_response_ids]),
                              Tokens(segment.new_token_ids, segment.new_logprobs, segment.new_versions), 1.0)
    assert versions == {first, first + 1}, (f"tokens of both versions, the second landed while the generator "
                                            f"ran: {sorted(versions)}, {generator.counters}")
    return generator, paused


# --- the policy endpoint's streams -------------------------------------------------------------------


def stream_rows(loop, engine, sequences, params, during=None, drop_after=None):
    """A job's streamed tokens per row (`engine.stream`, what the policy endpoint reads); `during`
    runs once the first tokens came (an update), `drop_after` = (row, tokens) drops that row then."""
    async def collect():
        steps, rows, ran, dropped = engine.stream(sequences, params), {}, False, False
        try:
            async for batch in steps:
                for s in batch:
                    rows.setdefault(s.row, []).append(s)
                if during is not None and not ran:
                    ran = True
                    await during()
                if drop_after is not None and not dropped and len(rows.get(drop_after[0], [])) >= drop_after[1]:
                    steps.drop([drop_after[0]])
                    dropped = True
        finally:
            steps.close()
        return rows, dropped

    return loop.run_until_complete(collect())


def check_streams_carry_the_learners_logprobs_across_an_update(loop, engine, models):
    """Streamed sequences (the policy endpoint's): every token's log-prob is the learner's under the
    weights of the version the engine gave it; an update that lands mid-stream cuts the requests,
    which continue under the new weights; each row ends with a reason."""
    params = SamplingParams(temperature=1.0)
    sequences = [sequence_input([4 + i] + PROMPTS[i], seed=120 + i, max_response_tokens=160) for i in range(4)]
    old = engine.weight_version
    new_model = perturbed(models[old], seed=old + 1)

    async def update():  # at once: the rows' first tokens came, and a fast engine ends 160 in under a second
        version = engine.weight_version + 1
        models[version] = new_model
        await asyncio.to_thread(load_in_thread, engine, new_model, version, "tensors")

    rows, _ = stream_rows(loop, engine, sequences, params, during=update)
    versions = set()
    for i, sequence in enumerate(sequences):
        steps = rows[i]
        assert steps[-1].finish is not None and all(s.finish is None for s in steps[:-1])
        out = Tokens(np.asarray([s.token for s in steps]), np.asarray([s.logprob for s in steps], dtype=np.float32),
                     np.asarray([s.version for s in steps]))
        versions |= set(out.versions.tolist())
        check_against_learner(models, sequence.prompt_ids, out, 1.0)
    assert versions == {old, old + 1}
    assert not engine._inflight  # noqa: SLF001 - every request came back


def check_a_dropped_row_stops_and_the_others_go_on_with_penalties_and_bias(loop, engine):
    bias = SamplingParams(temperature=1.0, logit_bias=((7, 100.0),))
    sequences = [sequence_input(p, seed=140 + i, max_response_tokens=200) for i, p in enumerate(PROMPTS[:2])]
    rows, dropped = stream_rows(loop, engine, sequences, bias, drop_after=(0, 5))
    assert all(s.token == 7 for s in rows[1]) and len(rows[1]) == 200  # the bias, honoured by the engine
    assert dropped and len(rows[0]) < 200  # row 0 stopped soon after it was dropped
    assert not engine._inflight  # noqa: SLF001
    # Near-greedy, with and without a presence penalty: the penalty reaches the engine's penalizer.
    greedy, penalised = SamplingParams(temperature=0.01), SamplingParams(temperature=0.01, presence_penalty=2.0)
    tokens = {}
    for name, params in (("greedy", greedy), ("penalised", penalised)):
        rows, _ = stream_rows(loop, engine, [sequence_input(PROMPTS[0], seed=1, max_response_tokens=20)], params)
        tokens[name] = [s.token for s in rows[0]]
    assert len(set(tokens["penalised"])) > len(set(tokens["greedy"]))


def check_a_lora_version_is_merged_into_the_base(loop, engine, models, **shape):
    """LoRA (`model.lora_rank`): a version reaches the server as its adapter; the engine merges it
    into the base weights of the model directory (never into an earlier version) and loads them. Two
    versions in a row, the second through the shared-memory path as the learner sends it; every
    token's log-prob is the learner's peft model's. `shape`: the module's tiny model's."""
    import torch

    from asyncrl.config import ModelConfig
    from asyncrl.weights import lora
    from asyncrl.weights.sync import AdapterSpec, Delivery

    settings = ModelConfig(source="hf", lora_rank=4, lora_alpha=8)
    params = SamplingParams(temperature=1.0)
    for seed, how in ((1, "direct"), (2, "shm")):
        learner, _ = tiny_qwen2(**shape)
        lora.wrap(learner, settings)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in learner.named_parameters():
                if ".lora_B." in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=generator))
        adapter = [(name, t.detach().clone()) for name, t in lora.adapter_tensors(learner.named_parameters())]
        version = engine.weight_version + 1
        models[version] = learner
        spec = AdapterSpec(settings.lora_rank, settings.lora_alpha)
        if how == "direct":
            loop.run_until_complete(asyncio.to_thread(engine.load_adapter, adapter, spec, version))
        else:
            deliver_over_shared_memory(loop, engine, Delivery(version, "shm", adapter=spec), adapter)
        (out,) = generate(loop, engine, [sequence_input(PROMPTS[1], seed=80 + seed, max_response_tokens=24)], 24, params)
        assert (out.versions == version).all()
        check_against_learner(models, PROMPTS[1], out, 1.0)
    base = learner_logprobs(tiny_qwen2(**shape)[0], PROMPTS[1], out.token_ids, 1.0)
    assert np.abs(base - out.logprobs).max() > 0.05  # the adapter matters


def check_deltas_change_the_version_the_generator_holds(loop, engine, models, **shape):
    """`policy.weight_delta`: a whole version, then two deltas, staged by the learner's
    `DeltaTracker` in the server's dtype (float32) and carried by shared memory as the learner sends
    them; each learner step moves one tensor in a few values (sent as indices and values) and one
    whole. Every token's log-prob is the learner's at each version. A delta from a version the
    generator does not hold is refused and changes nothing. `shape`: the module's tiny model's."""
    import copy

    import torch

    from asyncrl.weights.delta import DeltaTracker
    from asyncrl.weights.sync import Delivery, WeightTransferError

    def deliver(pieces, version, base):
        deliver_over_shared_memory(loop, engine, Delivery(version, "shm", delta_base=base), pieces)

    tracker, learner = DeltaTracker(torch.float32), tiny_qwen2(seed=3, **shape)[0]
    for step in range(3):
        if step:
            learner = copy.deepcopy(learner)
            with torch.no_grad():
                weights = dict(learner.named_parameters())
                weights["model.layers.0.self_attn.q_proj.weight"].view(-1)[step::97].add_(0.8)
                weights[f"model.layers.{step - 1}.mlp.gate_proj.weight"].mul_(-1.5)
        version = engine.weight_version + 1
        pieces, base, stats = tracker.stage(version, learner.named_parameters())
        assert (base, stats["tensors_changed"], stats["tensors_sparse"]) == ((-1, stats["tensors"], 0) if not step
                                                                             else (version - 1, 2, 1))
        deliver(pieces, version, base)
        models[version] = learner
        (out,) = generate(loop, engine, [sequence_input(PROMPTS[3], seed=90 + step, max_response_tokens=24)], 24,
                          SamplingParams(temperature=1.0))
        assert (out.versions == version).all()
        check_against_learner(models, PROMPTS[3], out, 1.0)
    stale, _, _ = DeltaTracker(torch.float32).stage(0, tiny_qwen2(**shape)[0].named_parameters())
    with pytest.raises(WeightTransferError, match=f"a delta from version {version - 1}, but this generator holds "
                                                  f"version {version}"):
        deliver(stale[:1], version + 1, version - 1)
    assert engine.weight_version == version


def check_the_policy_endpoint_answers(loop, engine, tiny, overrides: list[str]):
    """The `policy` application's class on the engine (`overrides` pick it), given the module's
    engine: a chat answer and its stream are whole (their lengths, log-probs and finish reasons), and
    `n` and tool calls behave as on the embedded engine. Returns the plain answer and the chunks."""
    import json

    from transformers import AutoTokenizer

    from asyncrl.api.requests import ChatCompletionRequest
    from asyncrl.config import compose
    from asyncrl.serve.policy import PolicyServer
    from asyncrl.serve.policy_engine import ServerPolicy

    config = compose(overrides + ["model.source=hf", f"model.path={tiny[0]}", "model.name=tiny-qwen2",
                                  "model.use_chat_template=false", "environment.tool_format=tiny",
                                  "serve.follow_learner=false"])
    server = PolicyServer.func_or_class.__bases__[0](config, policy=ServerPolicy(config, engine))
    body = {"messages": [{"role": "user", "content": "5:"}], "max_completion_tokens": 24, "seed": 4,
            "temperature": 1.0, "logprobs": True, "logit_bias": {str(EOS): -100}}

    async def ask(**fields):
        response = await server.chat_completions(ChatCompletionRequest(**{**body, **fields}))
        if fields.get("stream"):
            return [json.loads(c[6:]) async for c in response.body_iterator if c != "data: [DONE]\n\n"]
        return json.loads(response.body)

    plain = loop.run_until_complete(ask())
    chunks = loop.run_until_complete(ask(stream=True))
    assert plain["usage"]["completion_tokens"] == 24 and plain["choices"][0]["finish_reason"] == "length"
    # The content leaves special tokens out (`<pad>` may be sampled); the log-prob entries name them.
    special = set(AutoTokenizer.from_pretrained(tiny[0]).all_special_tokens)

    def text(entries):
        return "".join(e["token"] for e in entries if e["token"] not in special)

    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    entries = [e for c in chunks if c["choices"][0].get("logprobs") for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == 24 and text(entries) == streamed
    assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "length"
    plain_entries = plain["choices"][0]["logprobs"]["content"]
    assert len(plain_entries) == 24 and text(plain_entries) == plain["choices"][0]["message"]["content"]
    assert all(e["logprob"] <= 0 for e in entries + plain_entries)
    two = loop.run_until_complete(ask(n=2))
    assert len(two["choices"]) == 2 and two["usage"]["completion_tokens"] == 48
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    called = loop.run_until_complete(ask(tools=tools, tool_choice="required", logprobs=False))
    assert called["choices"][0]["finish_reason"] == "tool_calls"
    assert not engine._inflight  # noqa: SLF001 - nothing left running
    return plain, entries
