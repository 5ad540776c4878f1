"""SGLang for real (`engine=sglang_cpu`): one SGLang engine on a tiny random Qwen2 that this module
saves with transformers, checked against the learner's own log-probs for the same tokens
(`asyncrl.learning.scoring.response_logprobs`, the function the learner scores with).

Needs SGLang, which has an environment of its own: `make test-sglang` builds .venv-sglang (`make
sglang`) and runs this module there. The engine starts once for the module (about a minute of CPU);
tests that load weights look every token's weights up by the version SGLang reports for it, so each
test holds alone and in any order.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import numpy as np
import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang in its own environment: `make test-sglang` (builds .venv-sglang with `make sglang` "
                "and runs .venv-sglang/bin/python -m pytest tests/test_sglang_real.py)", allow_module_level=True)

from asyncrl.config import compose  # noqa: E402
from asyncrl.engines.base import SamplingParams  # noqa: E402
from asyncrl.engines.generation import sequence_input  # noqa: E402
from asyncrl.learning.scoring import LOGPROB_FLOOR, response_logprobs  # noqa: E402
from asyncrl.messages.structs import FinishReason  # noqa: E402
from asyncrl.models.loading import build_tiny_tokenizer  # noqa: E402
from asyncrl.weights.shared_memory import SharedSlots  # noqa: E402

# float32 on both sides: SGLang's CPU kernels and the learner's forward agree to ~1e-6.
TOLERANCE = 1e-4
EOS = build_tiny_tokenizer().eos_token_id
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20, 21], [22, 23, 24, 25, 26, 27]]


def tiny_qwen2(seed: int = 0):
    """A random Qwen2 over the tiny character tokenizer, with EOS made rare (~0.6% a token at T=1,
    ~2% at T=3) so that long requests stay long and EOS still comes at a hot temperature: residual
    dimension 0 is held at 50 (every embedding carries it, no layer writes it) and EOS's logit reads
    it with weight -0.5."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 50.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = -0.5
    return model, tokenizer


def perturbed(model, seed: int):
    """Other weights of the same shapes (attention and MLP inputs moved; dimension 0 left alone)."""
    from transformers import Qwen2ForCausalLM

    other = Qwen2ForCausalLM(model.config).float().eval()
    other.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return other


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model and the Hugging Face directory SGLang loads it from."""
    model, tokenizer = tiny_qwen2()
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory), model


@pytest.fixture(scope="module")
def models(tiny):
    """Weight version -> the model SGLang holds at that version (the learner's side of each check)."""
    return {0: tiny[1]}


@pytest.fixture(scope="module")
def engine(loop, tiny):
    from asyncrl.engines.sglang_launch import start_sglang

    config = compose(["engine=sglang_cpu", "model.source=hf", f"model.path={tiny[0]}", "engine.sglang_max_total_tokens=8192"])

    async def start():  # built on the loop that runs it, as in a generator actor
        return start_sglang(config.model, config.engine, seed=0)

    engine = loop.run_until_complete(start())
    yield engine
    engine.shutdown()


def generate(loop, engine, sequences, window_tokens, params):
    return loop.run_until_complete(engine.generate_window(sequences, window_tokens, params))


def learner_logprobs(model, context, new, temperature, top_k=0, top_p=1.0) -> np.ndarray:
    return response_logprobs(model, [(np.asarray(context), np.asarray(new))], temperature, top_k, top_p)[0]


def check_against_learner(models, context, out, temperature, top_k=0, top_p=1.0):
    """Every token's log-prob against the learner's under the weights of the version SGLang gave it."""
    for version in np.unique(out.versions):
        learner = learner_logprobs(models[int(version)], context, out.token_ids, temperature, top_k, top_p)
        mine = out.versions == version
        np.testing.assert_allclose(out.logprobs[mine], learner[mine], atol=TOLERANCE, rtol=0)


def load(loop, engine, models, model, how: str) -> int:
    """Give the engine `model` as the next version, from a worker thread (as the generator does)."""
    version = engine.weight_version + 1
    models[version] = model
    loop.run_until_complete(asyncio.to_thread(_load, engine, model, version, how))
    return version


def _load(engine, model, version, how):
    if how == "tensors":
        engine.update_weights(list(model.named_parameters()), version)
    else:
        slots = SharedSlots()
        try:
            engine.adopt_shared(slots.write(model.named_parameters()), version)
        finally:
            slots.close()


def test_windows_carry_the_learners_logprobs(loop, engine, models):
    sequences = [sequence_input(p, seed=i, max_response_tokens=64) for i, p in enumerate(PROMPTS)]
    outputs = generate(loop, engine, sequences, 24, SamplingParams(temperature=1.0))
    for prompt, out in zip(PROMPTS, outputs):
        assert (out.versions == engine.weight_version).all()
        check_against_learner(models, prompt, out, 1.0)
        ended = out.finish_reason is FinishReason.EOS
        assert ended == (out.token_ids[-1] == EOS) and (ended or len(out.token_ids) == 24)
        assert out.finish_reason in (FinishReason.EOS, FinishReason.WINDOW)


def test_top_k_top_p_tokens_carry_the_logprob_of_the_truncated_distribution(loop, engine, models):
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    sequences = [sequence_input(p, seed=10 + i, max_response_tokens=32) for i, p in enumerate(PROMPTS)]
    outputs = generate(loop, engine, sequences, 32, params)
    gaps = []
    for prompt, out in zip(PROMPTS, outputs):
        model = models[engine.weight_version]
        truncated = learner_logprobs(model, prompt, out.token_ids, 0.8, top_k=5, top_p=0.9)
        assert (truncated > LOGPROB_FLOOR).all(), "a token outside the top-k / top-p set was drawn"
        check_against_learner(models, prompt, out, 0.8, top_k=5, top_p=0.9)
        gaps += list(out.logprobs - learner_logprobs(model, prompt, out.token_ids, 0.8))
    # Renormalised after the cut, each is above the plain softmax(logits / T) log-prob.
    assert np.median(gaps) > 0.05


def test_min_p_as_the_policy_endpoint_asks_it_cuts_as_our_sampler_does(loop, engine, models):
    """vLLM's `min_p`, a request's setting on the policy endpoint, passed to SGLang through our own
    truncation: each token is within the min-p set and carries that set's renormalised log-prob."""
    from asyncrl.algo.sampling import filtered_logprobs

    params = SamplingParams(temperature=1.0, min_p=0.3)
    sequences = [sequence_input(p, seed=70 + i, max_response_tokens=24) for i, p in enumerate(PROMPTS)]
    model = models[engine.weight_version]
    for prompt, out in zip(PROMPTS, generate(loop, engine, sequences, 24, params)):
        ids = torch.tensor([list(prompt) + out.token_ids.tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        expected = filtered_logprobs(logits, 1.0, min_p=0.3).gather(-1, torch.as_tensor(out.token_ids, dtype=torch.long)[:, None])
        assert torch.isfinite(expected).all(), "a token below min-p was drawn"
        np.testing.assert_allclose(out.logprobs, expected.squeeze(-1).numpy(), atol=TOLERANCE, rtol=0)


def test_top_logprobs_are_those_of_the_distribution_sampled_from(loop, engine, models):
    """`SamplingParams.top_logprobs` as the policy endpoint asks for it: each position's most likely
    tokens under the cut distribution (top-k 5 at T=0.8), -inf past the cut, as the embedded engine."""
    from asyncrl.algo.sampling import filtered_logprobs

    params = SamplingParams(temperature=0.8, top_k=5, top_logprobs=6)
    outputs = generate(loop, engine, [sequence_input(p, seed=80 + i, max_response_tokens=12) for i, p in enumerate(PROMPTS)],
                       12, params)
    model = models[engine.weight_version]
    for prompt, out in zip(PROMPTS, outputs):
        assert out.top_ids.shape == out.top_logprobs.shape == (len(out.token_ids), 6)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids.tolist()])).logits[0, len(prompt) - 1:-1]
        expected = torch.topk(filtered_logprobs(logits, 0.8, 5), 6, dim=-1)
        np.testing.assert_allclose(out.top_logprobs[:, :5], expected.values[:, :5].numpy(), atol=TOLERANCE, rtol=0)
        assert np.isneginf(out.top_logprobs[:, 5]).all()  # the sixth is outside the cut: cannot be drawn
        assert (np.sort(out.top_ids[:, :5], axis=1) == np.sort(expected.indices[:, :5].numpy(), axis=1)).all()
        for row, token in enumerate(out.token_ids):  # the sampled token is among them, with its log-prob
            (where,) = np.nonzero(out.top_ids[row, :5] == token)
            assert len(where) == 1 and abs(out.top_logprobs[row, where[0]] - out.logprobs[row]) < TOLERANCE


def test_greedy_windows_take_the_learners_argmax(loop, engine, models):
    outputs = generate(loop, engine, [sequence_input(p, seed=0, max_response_tokens=12) for p in PROMPTS], 12,
                       SamplingParams(greedy=True))
    model = models[engine.weight_version]
    for prompt, out in zip(PROMPTS, outputs):
        ids = torch.tensor([prompt + out.token_ids.tolist()])
        with torch.no_grad():
            best = model(ids).logits[0, len(prompt) - 1:-1].argmax(-1)
        assert out.token_ids.tolist() == best.tolist()
        check_against_learner(models, prompt, out, 1.0)


def test_a_second_window_resends_its_prefix_and_reads_it_from_the_cache(loop, engine, models):
    params = SamplingParams(temperature=1.0)
    first = generate(loop, engine, [sequence_input(p, seed=20 + i, max_response_tokens=64) for i, p in enumerate(PROMPTS)],
                     16, params)
    running = [(p, o) for p, o in zip(PROMPTS, first) if not o.finished]
    assert running
    cached = engine.counters["cached_tokens"]
    second = generate(loop, engine, [sequence_input(p, seed=20 + i, max_response_tokens=64, response_ids=o.token_ids)
                                     for i, (p, o) in enumerate(running)], 16, params)
    for (prompt, out1), out2 in zip(running, second):
        check_against_learner(models, np.concatenate([prompt, out1.token_ids]), out2, 1.0)
    # The prefix came from the radix cache (SGLang caches whole pages: at least all but the last token).
    assert engine.counters["cached_tokens"] - cached >= sum(len(p) + 16 - 1 for p, _ in running)


def test_fire_first_token_carries_the_hot_distributions_logprob(loop, engine, models):
    params = SamplingParams(temperature=1.0, first_token_temperature=3.0, first_token_top_k=4)
    outputs = generate(loop, engine, [sequence_input(p, seed=30 + i, max_response_tokens=16) for i, p in enumerate(PROMPTS)],
                       16, params)
    model = models[engine.weight_version]
    for prompt, out in zip(PROMPTS, outputs):
        first, rest = out.token_ids[:1], out.token_ids[1:]
        hot = learner_logprobs(model, prompt, first, 3.0, top_k=4)
        assert hot[0] > LOGPROB_FLOOR, "FIRE's first token is outside its top-k guard"
        assert abs(out.logprobs[0] - hot[0]) < TOLERANCE
        assert out.logprobs[0] - learner_logprobs(model, prompt, first, 3.0)[0] > 0.1  # renormalised over 4 tokens
        if len(rest):
            regular = learner_logprobs(model, prompt, out.token_ids, 1.0)[1:]
            np.testing.assert_allclose(out.logprobs[1:], regular, atol=TOLERANCE, rtol=0)
        # Exact, but of the hot distribution: unscored, as the embedded engine marks it.
        assert out.scored is not None and out.scored.tolist() == [0] + [1] * len(rest)
    # A later window of the same responses has no first token: every token scored.
    later = generate(loop, engine, [sequence_input(p, seed=30 + i, max_response_tokens=32, response_ids=o.token_ids)
                                    for i, (p, o) in enumerate(zip(PROMPTS, outputs)) if not o.finished], 4, params)
    assert all(o.scored is None for o in later)


def test_eos_stops_a_window(loop, engine, models):
    sequences = [sequence_input(PROMPTS[i % len(PROMPTS)], seed=40 + i, max_response_tokens=120) for i in range(12)]
    outputs = generate(loop, engine, sequences, 120, SamplingParams(temperature=3.0))
    stopped = [(s, o) for s, o in zip(sequences, outputs) if o.finish_reason is FinishReason.EOS]
    assert stopped, "no sequence reached EOS in 12 x 120 tokens at T=3 (~2% a token)"
    for sequence, out in stopped:
        assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1].tolist()
        check_against_learner(models, sequence.prompt_ids, out, 3.0)
    for sequence, out in zip(sequences, outputs):
        assert out.finish_reason in (FinishReason.EOS, FinishReason.MAX_LENGTH)
        assert (out.finish_reason is FinishReason.MAX_LENGTH) == (len(out.token_ids) == 120)


def test_a_minimum_length_holds_eos_back(loop, engine):
    params = SamplingParams(temperature=3.0)
    free = [sequence_input(PROMPTS[i % len(PROMPTS)], seed=50 + i, max_response_tokens=60) for i in range(12)]
    held = [sequence_input(s.prompt_ids, seed=s.seed, max_response_tokens=60, min_response_tokens=40) for s in free]
    without, with_min = generate(loop, engine, free, 60, params), generate(loop, engine, held, 60, params)
    assert any(o.finish_reason is FinishReason.EOS and len(o.token_ids) < 40 for o in without)
    for out in with_min:
        assert len(out.token_ids) > 40 and EOS not in out.token_ids[:40].tolist()
        # EOS held back: those 40 positions were not drawn from the policy's distribution.
        assert out.scored.tolist() == [0] * 40 + [1] * (len(out.token_ids) - 40)
    assert all(o.scored is None for o in without)


def test_an_update_mid_request_lands_at_once_and_later_tokens_follow_the_new_weights(loop, engine, models):
    """Shared-memory path (CPU). The update is applied while a long window runs; its requests are
    cut and continue under the new weights with nothing read from the cache of the old ones."""
    params = SamplingParams(temperature=1.0)
    # Twelve prompts that share no prefix: a continued request may read from the cache only what
    # another continued request computed under the new weights, and with no shared prefix there is
    # none of that either, so any cached token it reads would be one computed under the old weights.
    sequences = [sequence_input([3 + i] + PROMPTS[i % len(PROMPTS)], seed=60 + i, max_response_tokens=232)
                 for i in range(12)]
    start = time.perf_counter()
    warm = generate(loop, engine, sequences, 32, params)
    per_token = (time.perf_counter() - start) / 32
    live = [(s, o) for s, o in zip(sequences, warm) if not o.finished]
    continued = [sequence_input(s.prompt_ids, seed=s.seed, max_response_tokens=232, response_ids=o.token_ids)
                 for s, o in live]
    before = dict(engine.counters)
    old = engine.weight_version
    new_model = perturbed(models[old], seed=engine.weight_version + 1)

    async def window_with_update():
        window = asyncio.ensure_future(engine.generate_window(continued, 200, params))
        await asyncio.sleep(60 * per_token)  # about 60 tokens into the window
        version = engine.weight_version + 1
        models[version] = new_model
        await asyncio.to_thread(_load, engine, new_model, version, "shared")
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


def test_nothing_cached_under_old_weights_is_reused(loop, engine, models):
    """Tensor path (CUDA IPC handles on a GPU): a prefix cached before an update is computed again."""
    params = SamplingParams(temperature=1.0)
    prompt = [5, 9, 13, 17, 21, 25, 6, 10, 14, 18, 22, 26, 7, 11, 15, 19]
    sequence = sequence_input(prompt, seed=70, max_response_tokens=8)
    generate(loop, engine, [sequence], 8, params)
    cached = engine.counters["cached_tokens"]
    generate(loop, engine, [sequence], 8, params)
    assert engine.counters["cached_tokens"] - cached >= len(prompt) - 1  # the same weights: read from the cache
    load(loop, engine, models, perturbed(models[engine.weight_version], seed=engine.weight_version + 1), "tensors")
    cached = engine.counters["cached_tokens"]
    (out,) = generate(loop, engine, [sequence], 8, params)
    assert engine.counters["cached_tokens"] == cached  # new weights: nothing read
    assert (out.versions == engine.weight_version).all()
    check_against_learner(models, prompt, out, 1.0)


def test_the_generator_role_loads_versions_before_and_while_it_runs(loop, engine, models):
    """`actors.generator.Generator` on SGLang, as a generator actor runs it: a version delivered
    before its loop starts (joining the pool) loads at once; one delivered while it runs lands
    mid-window (`updates_mid_window`). Every token's recorded version is the one SGLang reported,
    and its log-prob is the learner's under those weights."""
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
        await deliver(perturbed(models[engine.weight_version], seed=first), first)  # not running: loads now
        assert engine.weight_version == first
        await prompts.put([PromptRequest(prompt_id=f"g{i}", prompt_token_ids=int32_array(p), group_size=2, seed=90 + i)
                           for i, p in enumerate(PROMPTS[:4])])
        running = asyncio.ensure_future(generator.run())
        while generator.counters["tokens"] == 0:
            await asyncio.sleep(0.05)
        paused = await deliver(perturbed(models[first], seed=first + 1), first + 1)  # mid-window
        while generator.counters["samples_finished"] < 8:
            await asyncio.sleep(0.1)
        generator.stop()
        await running
        return first, paused

    try:
        first, paused = loop.run_until_complete(scenario())
    finally:
        slots.close()
    got = loop.run_until_complete(segments.get(10_000, timeout=0.1))
    assert generator.counters["weight_updates"] == 1 and paused < 30
    versions = set()
    for segment in got:
        assert len(segment.new_versions) == len(segment.new_token_ids)
        versions |= set(segment.new_versions.tolist())
        check_against_learner(models, np.concatenate([segment.prompt_token_ids, segment.prior_response_ids]),
                              _Out(segment.new_token_ids, segment.new_logprobs, segment.new_versions), 1.0)
    assert versions == {first, first + 1}, "tokens of both versions: the second landed while the generator ran"


class _Out:
    def __init__(self, token_ids, logprobs, versions):
        self.token_ids, self.logprobs, self.versions = token_ids, logprobs, versions


# --- the policy endpoint on SGLang -------------------------------------------------------------------


def stream_rows(loop, engine, sequences, params, during=None, drop_after=None):
    """A job's streamed tokens per row (`SGLangSteps`, what the policy endpoint reads); `during` runs
    once the first tokens came (an update), `drop_after` = (row, tokens) drops that row then."""
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


def test_the_endpoint_streams_sglangs_tokens_with_the_learners_logprobs_across_an_update(loop, engine, models):
    """Streamed sequences (the policy endpoint's): every token's log-prob is the learner's under the
    weights of the version SGLang gave it; an update that lands mid-stream cuts the requests, which
    continue under the new weights; each row ends with a reason."""
    params = SamplingParams(temperature=1.0)
    sequences = [sequence_input([4 + i] + PROMPTS[i], seed=120 + i, max_response_tokens=160) for i in range(4)]
    old = engine.weight_version
    new_model = perturbed(models[old], seed=old + 1)

    async def update():
        await asyncio.sleep(0.5)
        version = engine.weight_version + 1
        models[version] = new_model
        await asyncio.to_thread(_load, engine, new_model, version, "tensors")

    rows, _ = stream_rows(loop, engine, sequences, params, during=update)
    versions = set()
    for i, sequence in enumerate(sequences):
        steps = rows[i]
        assert steps[-1].finish is not None and all(s.finish is None for s in steps[:-1])
        out = _Out(np.asarray([s.token for s in steps]), np.asarray([s.logprob for s in steps], dtype=np.float32),
                   np.asarray([s.version for s in steps]))
        versions |= set(out.versions.tolist())
        check_against_learner(models, sequence.prompt_ids, out, 1.0)
    assert versions == {old, old + 1}
    assert not engine._inflight  # noqa: SLF001 - every request came back


def test_a_dropped_row_is_aborted_and_the_others_go_on_with_penalties_and_bias(loop, engine):
    bias = SamplingParams(temperature=1.0, logit_bias=((7, 100.0),))
    sequences = [sequence_input(p, seed=140 + i, max_response_tokens=200) for i, p in enumerate(PROMPTS[:2])]
    rows, dropped = stream_rows(loop, engine, sequences, bias, drop_after=(0, 5))
    assert all(s.token == 7 for s in rows[1]) and len(rows[1]) == 200  # the bias, honoured by SGLang
    assert dropped and len(rows[0]) < 200  # row 0 stopped soon after it was dropped
    assert not engine._inflight  # noqa: SLF001
    # Near-greedy, with and without a presence penalty: the penalty reaches SGLang's penalizer.
    greedy, penalised = SamplingParams(temperature=0.01), SamplingParams(temperature=0.01, presence_penalty=2.0)
    tokens = {}
    for name, params in (("greedy", greedy), ("penalised", penalised)):
        rows, _ = stream_rows(loop, engine, [sequence_input(PROMPTS[0], seed=1, max_response_tokens=20)], params)
        tokens[name] = [s.token for s in rows[0]]
    assert len(set(tokens["penalised"])) > len(set(tokens["greedy"]))


def test_the_policy_endpoint_answers_from_sglang(loop, engine, tiny):
    """The `policy` application's class on SGLang (`engine=sglang`), given this module's engine: a
    chat answer and its stream are whole (their lengths, log-probs and finish reasons), and `n` and
    tool calls behave as on the embedded engine."""
    import json

    from asyncrl.api.requests import ChatCompletionRequest
    from asyncrl.serve.policy import PolicyServer
    from asyncrl.serve.policy_engine import SGLangPolicy

    config = compose(["engine=sglang_cpu", "model.source=hf", f"model.path={tiny[0]}", "model.name=tiny-qwen2",
                      "model.use_chat_template=false", "environment.tool_format=tiny", "serve.follow_learner=false"])
    server = PolicyServer.func_or_class.__bases__[0](config, policy=SGLangPolicy(config, engine))
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
    # SGLang honours a request's seed only in its deterministic mode (which turns its radix cache off
    # on this backend), so a plain answer and a stream are two samples: each is whole and its own.
    # The content leaves special tokens out (`<pad>` may be sampled); the log-prob entries name them.
    from transformers import AutoTokenizer

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


# Last: it leaves SGLang's weights LoRA-merged, which the tests above do not expect.
def test_a_lora_version_is_merged_into_the_base_and_its_tokens_are_the_learners(loop, engine, models):
    """LoRA (`model.lora_rank`): a version reaches SGLang as its adapter; the engine merges it into
    the base weights of the model directory (never into an earlier version) and loads the merged
    modules. Two versions in a row, the second through the shared-memory path as the learner sends
    it; every token's log-prob is the learner's peft model's."""
    from asyncrl.weights import lora, transport
    from asyncrl.config import ModelConfig
    from asyncrl.weights.sync import AdapterSpec, Delivery

    settings = ModelConfig(source="hf", lora_rank=4, lora_alpha=8)
    params = SamplingParams(temperature=1.0)
    for seed, how in ((1, "direct"), (2, "shm")):
        learner, _ = tiny_qwen2()
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
            slots = SharedSlots()
            try:
                delivery = Delivery(version, "shm", adapter=spec)
                loop.run_until_complete(asyncio.to_thread(transport.load, engine, delivery, slots.write(adapter), None))
            finally:
                slots.close()
        (out,) = generate(loop, engine, [sequence_input(PROMPTS[1], seed=80 + seed, max_response_tokens=24)], 24, params)
        assert (out.versions == version).all()
        check_against_learner(models, PROMPTS[1], out, 1.0)
    base = learner_logprobs(tiny_qwen2()[0], PROMPTS[1], out.token_ids, 1.0)
    assert np.abs(base - out.logprobs).max() > 0.05  # the adapter matters
