"""Rows with sampling settings of their own share a decode step (issue: one client's temperature
starved the endpoint): the per-row sampling functions, the engine's mixed windows, the batcher."""

import asyncio
import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.algo.sampling import filtered_logprobs, penalised_logits, step_logprobs
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.batching import WindowBatcher
from asyncrl.engines.generation import sequence_input
from asyncrl.engines.torch_engine import TorchEngine

NO_EOS = (10_000,)  # outside the vocabulary: rows run to their length


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_most_likely_by_hand():
    """p = (0.5, 0.3, 0.15, 0.05), min_p 0.2: the floor is 0.1, so 0.05 goes and the rest are
    renormalised over 0.95."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = filtered_logprobs(probs.log(), 1.0, min_p=0.2).exp()
    torch.testing.assert_close(lp, torch.tensor([[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]]))
    assert torch.equal(filtered_logprobs(probs.log(), 1.0, min_p=0.0), torch.log_softmax(probs.log(), -1))


def test_per_row_settings_give_each_row_what_it_gets_alone():
    """Temperature, top-k, top-p and min-p as one value per row: each row's distribution is,
    bit for bit, the one its own settings give it alone (and a row's neighbours change nothing)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    temperature = [1.0, 0.5, 1.3, 0.7, 1.0, 2.0]
    top_k = [0, 5, 0, 12, 1, 0]
    top_p = [1.0, 1.0, 0.8, 0.9, 1.0, 0.3]
    min_p = [0.0, 0.0, 0.0, 0.05, 0.0, 0.1]
    together = filtered_logprobs(logits, torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p),
                                 torch.tensor(min_p))
    for row in range(6):
        alone = filtered_logprobs(logits[row:row + 1], temperature[row], top_k[row], top_p[row], min_p[row])
        assert torch.equal(together[row:row + 1], alone), row
    assert int(torch.isfinite(together[4]).sum()) == 1  # top-k 1: the argmax alone


def test_fire_per_row_heats_only_the_rows_that_ask_and_penalties_per_row():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    positions = torch.tensor([0, 0, 4])
    fire = torch.tensor([5.0, float("nan"), 5.0])  # row 1 has FIRE off; row 2 is past its first token
    mixed = step_logprobs(logits, positions, 1.0, 0, 1.0, fire, torch.tensor([3, 3, 3]))
    assert torch.equal(mixed[0], step_logprobs(logits[:1], positions[:1], 1.0, 0, 1.0, 5.0, 3)[0])
    assert torch.equal(mixed[1:], filtered_logprobs(logits[1:], 1.0))
    counts = torch.zeros(2, 40)
    counts[:, 7] = 2.0
    out = penalised_logits(logits[:2], counts, torch.tensor([0.5, 0.0]), torch.tensor([0.25, 0.0]), None)
    assert math.isclose(float(out[0, 7]), float(logits[0, 7]) - 0.25 * 2 - 0.5, abs_tol=1e-6)
    assert torch.equal(out[1], logits[1])


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def engine(request):
    """A tiny random Llama, and a tiny random Qwen3-MoE (the policy endpoint's path for a
    mixture-of-experts model), on the engine's own decoder, with vocabularies wide enough for
    top-k, top-p and min-p to cut."""
    torch.manual_seed(0)
    if request.param == "qwen3_moe":
        from asyncrl.bench.moe import tiny_moe

        model = tiny_moe()
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    built = TorchEngine(model.eval(), NO_EOS, pad_token_id=0)
    assert built.decoder is not None
    assert built.keeps_caches
    return built


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.4), SamplingParams(temperature=1.0, top_k=5),
            SamplingParams(temperature=0.8, top_p=0.7), SamplingParams(temperature=1.0, min_p=0.1),
            SamplingParams(greedy=True), SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5),
            SamplingParams(temperature=1.0, logit_bias=((3, 5.0), (4, -100.0))),
            SamplingParams(temperature=0.7, first_token_temperature=3.0, first_token_top_k=4),
            SamplingParams(temperature=1.2, top_logprobs=3)]


def test_one_window_of_rows_with_every_kind_of_setting_samples_what_each_samples_alone(engine):
    sequences = [sequence_input([5 + i, 6, 7], 100 + i, 20) for i in range(len(SETTINGS))]
    together = engine.generate_window_sync(sequences, 20, SETTINGS)
    for i, (sequence, params) in enumerate(zip(sequences, SETTINGS)):
        alone = engine.generate_window_sync([sequence], 20, params)[0]
        assert together[i].token_ids.tolist() == alone.token_ids.tolist(), (i, params)
        # (the forward's matmuls round by batch shape: tokens equal, log-probs to float32 rounding)
        np.testing.assert_allclose(together[i].logprobs, alone.logprobs, atol=1e-5)
    assert together[9].top_ids.shape == (20, 3)
    assert together[8].scored is not None and together[8].scored[0] == 0  # FIRE's first token is marked
    assert 4 not in together[7].token_ids.tolist()
    with pytest.raises(ValueError, match="2 sampling settings for 3 sequences"):
        engine.generate_window_sync(sequences[:3], 4, SETTINGS[:2])


def test_jobs_with_their_own_settings_share_windows_and_keep_their_samples(engine):
    """Ten jobs, each with its own settings, at once: about as few windows as one job of theirs
    needs, 3 (they share windows; taking turns was 30), and each job's tokens are those it gets alone."""
    async def job(batcher, i):
        steps = batcher.stream([sequence_input([5, 6, 7 + i], 10 * i + k, 24) for k in range(2)], SETTINGS[i])
        tokens: dict[int, list] = {}
        try:
            async for batch in steps:
                for s in batch:
                    tokens.setdefault(s.row, []).append(s.token)
        finally:
            steps.close()
        return tokens

    async def main():
        batcher = WindowBatcher(engine, max_rows=64, window_tokens=8, max_positions=1 << 20)
        alone = [await job(batcher, i) for i in range(len(SETTINGS))]
        before = batcher.counters["windows"]
        together = await asyncio.gather(*(job(batcher, i) for i in range(len(SETTINGS))))
        return alone, together, batcher.counters["windows"] - before

    alone, together, windows = asyncio.run(main())
    assert list(together) == alone
    assert windows <= 4  # 24 tokens in windows of 8 (one more where some job came after the first began)


def test_a_short_request_under_sixty_jobs_each_with_its_own_temperature_waits_a_window_not_their_turns():
    """The probe that found the starvation, on the endpoint's own batcher and defaults (tiny model):
    60 jobs of n=4, 120 tokens, each at its own temperature, then an 8-token request. It is
    answered within two windows of its arrival (before: after every other setting's turn, 165
    windows), and the jobs sample what they sample alone."""
    from asyncrl.config import compose
    from asyncrl.serve.policy_engine import EmbeddedPolicy

    batcher = EmbeddedPolicy(compose(["model=tiny", "serve.follow_learner=false"])).batcher

    async def job(seed, temperature, n, max_tokens):
        steps = batcher.stream([sequence_input([5, 6, 7], seed * 10 + k, max_tokens) for k in range(n)],
                               SamplingParams(temperature=temperature), live=False)
        try:
            return [(s.row, s.token) async for batch in steps for s in batch]
        finally:
            steps.close()

    async def main():
        alone = {s: await job(s, 0.5 + s / 100, 4, 120) for s in (0, 31, 59)}
        load = [asyncio.create_task(job(s, 0.5 + s / 100, 4, 120)) for s in range(60)]
        while not batcher.stats()["running_requests"]:
            await asyncio.sleep(0)
        arrived = batcher.counters["windows"]
        await job(777, 1.0, 1, 8)
        waited = batcher.counters["windows"] - arrived
        together = await asyncio.gather(*load)
        return alone, together, waited

    alone, together, waited = asyncio.run(main())
    assert waited <= 2, waited
    assert all(together[s] == alone[s] for s in alone)
