"""vLLM for real (`engine=vllm`): one vLLM engine (its CPU build) on a tiny random Qwen2 that this
module saves with transformers, checked against the learner's own log-probs for the same tokens
(`asyncrl.learning.scoring.response_logprobs`, the function the learner scores with).

Needs vLLM, which has an environment of its own: `make test-vllm` builds .venv-vllm (`make vllm`)
and runs this module there. The engine starts once for the module (about a minute of CPU); tests
that load weights look every token's weights up by the version the engine gave it, so each test
holds alone and in any order.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import numpy as np
import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM in its own environment: `make test-vllm` (builds .venv-vllm with `make vllm` "
                "and runs .venv-vllm/bin/python -m pytest tests/test_vllm_real.py)", allow_module_level=True)

from asyncrl.config import compose  # noqa: E402
from asyncrl.engines.base import SamplingParams  # noqa: E402
from asyncrl.engines.generation import sequence_input  # noqa: E402
from asyncrl.learning.scoring import LOGPROB_FLOOR, response_logprobs  # noqa: E402
from asyncrl.messages.structs import FinishReason  # noqa: E402
from asyncrl.models.loading import build_tiny_tokenizer  # noqa: E402
from asyncrl.weights.shared_memory import SharedSlots  # noqa: E402
from tiny_hf_models import perturbed, tiny_qwen2  # noqa: E402

# float32 on both sides: vLLM's CPU kernels and the learner's forward agree to ~1e-6.
TOLERANCE = 1e-4
EOS = build_tiny_tokenizer().eos_token_id
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20, 21], [22, 23, 24, 25, 26, 27]]
HIDDEN = 128  # four heads of 32: a head size vLLM's CPU attention takes


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model and the Hugging Face directory vLLM loads it from."""
    model, tokenizer = tiny_qwen2(hidden_size=HIDDEN)
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory), model


@pytest.fixture(scope="module")
def models(tiny):
    """Weight version -> the model vLLM holds at that version (the learner's side of each check)."""
    return {0: tiny[1]}


@pytest.fixture(scope="module")
def engine(loop, tiny):
    from asyncrl.engines.vllm_launch import start_vllm

    config = compose(["engine=vllm", "model.source=hf", f"model.path={tiny[0]}", "engine.vllm_kv_cache_mb=64"])

    async def start():  # built on the loop that runs it, as in a generator actor
        return start_vllm(config.model, config.engine, seed=0)

    engine = loop.run_until_complete(start())
    yield engine
    engine.shutdown()


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


def test_what_vllm_cannot_do_is_refused_at_start_up():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from asyncrl.config.checks import VLLM_CPU_HEAD_SIZES

    assert list(VLLM_CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())
    with pytest.raises(ValueError, match="no kernel for this model's head size 16"):
        compose(["engine=vllm", "model=tiny", "task=tiny"])
    assert compose(["engine=vllm", "model=tiny", "model.num_heads=2", "task=tiny"]).engine.name == "vllm"
    with pytest.raises(ValueError, match="vLLM samples at temperatures up to 2"):
        compose(["engine=vllm", "sampling.first_token_temperature=3.0"])
    from vllm import SamplingParams as VLLMSampling
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="temperature must be in"):  # what the refusal stands for
        VLLMSampling(temperature=3.0)


def test_windows_carry_the_learners_logprobs(loop, engine, models):
    sequences = [sequence_input(p, seed=i, max_response_tokens=64) for i, p in enumerate(PROMPTS)]
    outputs = generate(loop, engine, sequences, 24, SamplingParams(temperature=1.0))
    for prompt, out in zip(PROMPTS, outputs):
        assert (out.versions == engine.weight_version).all()
        check_against_learner(models, prompt, out, 1.0)
        ended = out.finish_reason is FinishReason.EOS
        assert ended == (out.token_ids[-1] == EOS) and (ended or len(out.token_ids) == 24)
        assert out.finish_reason in (FinishReason.EOS, FinishReason.WINDOW)


def test_a_seed_draws_the_same_tokens_and_another_seed_others(loop, engine):
    params = SamplingParams(temperature=1.0)
    again = [generate(loop, engine, [sequence_input(PROMPTS[1], seed=s, max_response_tokens=24)], 24, params)[0]
             for s in (7, 7, 8)]
    assert again[0].token_ids.tolist() == again[1].token_ids.tolist()
    assert again[0].token_ids.tolist() != again[2].token_ids.tolist()


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
    # Renormalised after the cut (vLLM's processed log-probs), each is above the plain softmax(logits / T).
    assert np.median(gaps) > 0.05


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
    first = generate(loop, engine, [sequence_input(p, seed=20 + i, max_response_tokens=96) for i, p in enumerate(PROMPTS)],
                     40, params)
    running = [(p, o) for p, o in zip(PROMPTS, first) if not o.finished]
    assert running
    cached = engine.counters["cached_tokens"]
    second = generate(loop, engine, [sequence_input(p, seed=20 + i, max_response_tokens=96, response_ids=o.token_ids)
                                     for i, (p, o) in enumerate(running)], 16, params)
    for (prompt, out1), out2 in zip(running, second):
        check_against_learner(models, np.concatenate([prompt, out1.token_ids]), out2, 1.0)
    # vLLM caches whole blocks (engine.vllm_block_tokens=32): each context of 42 to 46 tokens has
    # its first block read from the cache.
    assert engine.counters["cached_tokens"] - cached >= 32 * len(running)


def test_fire_first_token_carries_the_hot_distributions_logprob(loop, engine, models):
    params = SamplingParams(temperature=1.0, first_token_temperature=2.0, first_token_top_k=4)  # vLLM's most
    outputs = generate(loop, engine, [sequence_input(p, seed=30 + i, max_response_tokens=16) for i, p in enumerate(PROMPTS)],
                       16, params)
    model = models[engine.weight_version]
    for prompt, out in zip(PROMPTS, outputs):
        first, rest = out.token_ids[:1], out.token_ids[1:]
        hot = learner_logprobs(model, prompt, first, 2.0, top_k=4)
        assert hot[0] > LOGPROB_FLOOR, "FIRE's first token is outside its top-k guard"
        assert abs(out.logprobs[0] - hot[0]) < TOLERANCE
        if len(rest):
            regular = learner_logprobs(model, prompt, out.token_ids, 1.0)[1:]
            np.testing.assert_allclose(out.logprobs[1:], regular, atol=TOLERANCE, rtol=0)
        assert out.scored is not None and out.scored.tolist() == [0] + [1] * len(rest)


def test_eos_stops_a_window_and_a_minimum_length_holds_it_back(loop, engine, models):
    params = SamplingParams(temperature=2.0)  # vLLM's highest
    free = [sequence_input(PROMPTS[i % len(PROMPTS)], seed=40 + i, max_response_tokens=60) for i in range(24)]
    outputs = generate(loop, engine, free, 60, params)
    stopped = [(s, o) for s, o in zip(free, outputs) if o.finish_reason is FinishReason.EOS]
    assert stopped, "no sequence reached EOS in 24 x 60 tokens at T=2"
    for sequence, out in stopped:
        assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1].tolist()
        check_against_learner(models, sequence.prompt_ids, out, 2.0)
    for out in outputs:
        assert (out.finish_reason is FinishReason.MAX_LENGTH) == (len(out.token_ids) == 60 and out.token_ids[-1] != EOS)
    held = [sequence_input(s.prompt_ids, seed=s.seed, max_response_tokens=60, min_response_tokens=40) for s in free]
    for out in generate(loop, engine, held, 60, params):
        assert len(out.token_ids) > 40 and EOS not in out.token_ids[:40].tolist()
        assert out.scored.tolist() == [0] * 40 + [1] * (len(out.token_ids) - 40)


def test_an_update_mid_request_lands_at_once_and_later_tokens_follow_the_new_weights(loop, engine, models):
    """Shared-memory path. The update is applied while a long window runs; its requests are cut
    and continue under the new weights with nothing read from the cache of the old ones."""
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


def test_an_update_by_tensors_changes_the_outputs_and_nothing_cached_before_is_read(loop, engine, models):
    prompt = [5, 9, 13, 17, 21, 25, 6, 10, 14, 18, 22, 26, 7, 11, 15, 19, 23] * 2  # longer than one block
    sequence = sequence_input(prompt, seed=70, max_response_tokens=8)
    (before,) = generate(loop, engine, [sequence], 8, SamplingParams(greedy=True))
    cached = engine.counters["cached_tokens"]
    generate(loop, engine, [sequence], 8, SamplingParams(greedy=True))
    assert engine.counters["cached_tokens"] - cached >= 32  # the same weights: read from the cache
    load(loop, engine, models, perturbed(models[engine.weight_version], seed=engine.weight_version + 1), "tensors")
    cached = engine.counters["cached_tokens"]
    (after,) = generate(loop, engine, [sequence], 8, SamplingParams(greedy=True))
    assert engine.counters["cached_tokens"] == cached  # new weights: nothing read
    assert (after.versions == engine.weight_version).all()
    check_against_learner(models, prompt, after, 1.0)
    assert not np.allclose(after.logprobs, before.logprobs, atol=1e-3)


def test_the_generator_role_loads_versions_before_and_while_it_runs(loop, engine, models):
    """`actors.generator.Generator` on vLLM, as a generator actor runs it: a version delivered
    before its loop starts loads at once; one delivered while it runs lands mid-window. Every
    token's recorded version is exact: its log-prob is the learner's under those weights."""
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
        await deliver(perturbed(models[first], seed=first + 1), first + 1)  # mid-window
        while generator.counters["samples_finished"] < 8:
            await asyncio.sleep(0.1)
        generator.stop()
        await running
        return first

    try:
        first = loop.run_until_complete(scenario())
    finally:
        slots.close()
    got = loop.run_until_complete(segments.get(10_000, timeout=0.1))
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


# --- a run -----------------------------------------------------------------------------------------


def test_the_tiny_task_trains_through_vllm_generators(ray_session, tmp_path):
    """The whole pipeline (Ray actors, mailboxes, the learner's shared-memory sender) with vLLM in
    the generator: a few steps of the tiny task, each version loaded into the running vLLM, every
    admitted sample accounted for."""
    from asyncrl.driver import train

    config = compose(["engine=vllm", "model=tiny", "model.num_heads=2", "task=tiny", "algorithm=grpo",
                      "engine.vllm_kv_cache_mb=64", "trainer.total_steps=3", f"trainer.run_dir={tmp_path}",
                      "trainer.wandb_mode=disabled"])
    summary = train(config, progress=False, eval_prompts=4)
    records = summary["records"]
    assert [r["step"] for r in records] == [1, 2, 3]
    status = summary["final_status"]
    assert status["weight_version"] >= 3
    assert status["last_broadcast"]["paths"] == ["shm"]
    assert status["ledger"]["problems"] == [], status["ledger"]["problems"]
    assert status["ledger"]["trained"] > 0
    # Generated by vLLM under the learner's versions: each step trained tokens of a recent version.
    assert max(r["staleness_max"] for r in records) <= config.algorithm.max_staleness_versions
