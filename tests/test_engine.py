import asyncio

import numpy as np
import pytest
import torch

from asyncrl.algo.sampling import (
                                   counter_uniform,
                                   filtered_logprobs,
                                   sample_from_logits,
                                   sample_from_logprobs,
                                   step_logprobs,
                                   )
from asyncrl.config import ModelConfig
from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.messages.structs import FinishReason, int32_array
from asyncrl.models.loading import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(ModelConfig(source="tiny", seed=3), len(tok))
    return model, tok


def engine_for(model, eos=(1,)):
    return TorchEngine(model, eos_token_ids=eos, pad_token_id=0)


def seq(prompt, response=(), seed=0, max_tokens=64):
    return SequenceInput(
        prompt_ids=int32_array(prompt), response_ids=int32_array(list(response)), seed=seed,
        max_response_tokens=max_tokens,
    )


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [4]]
# An EOS id outside the vocabulary: never sampled, so windows are full.
NO_EOS = (10_000,)


def teacher_forced_logprobs(model, prompt, response, temperature=1.0, top_k=0, top_p=1.0):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    lp = filtered_logprobs(logits[len(prompt) - 1 : -1], temperature, top_k, top_p)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).numpy()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=12)])
def test_logprobs_match_teacher_forced_pass(tiny, params):
    model, _ = tiny
    engine = engine_for(model, NO_EOS)
    outs = engine.generate_window_sync([seq(p, seed=i) for i, p in enumerate(PROMPTS)], 12, params)
    for prompt, out in zip(PROMPTS, outs):
        ref = teacher_forced_logprobs(model, prompt, out.token_ids.tolist(), params.temperature, params.top_k, params.top_p)
        np.testing.assert_allclose(out.logprobs, ref, atol=1e-4)


def test_three_windows_equal_one_long_generation(tiny):
    model, _ = tiny
    engine = engine_for(model, NO_EOS)
    params = SamplingParams(temperature=1.0)
    whole = engine.generate_window_sync([seq(p, seed=10 + i) for i, p in enumerate(PROMPTS)], 24, params)
    responses = [[] for _ in PROMPTS]
    logprobs = [[] for _ in PROMPTS]
    for window in range(3):
        outs = engine.generate_window_sync(
            [seq(p, responses[i], seed=10 + i) for i, p in enumerate(PROMPTS)], 8, params
        )
        for i, out in enumerate(outs):
            assert out.finish_reason is FinishReason.WINDOW
            responses[i] += out.token_ids.tolist()
            logprobs[i] += out.logprobs.tolist()
    for i, out in enumerate(whole):
        assert out.token_ids.tolist() == responses[i]
        np.testing.assert_allclose(out.logprobs, logprobs[i], atol=1e-4)


def test_batch_composition_does_not_change_samples(tiny):
    model, _ = tiny
    engine = engine_for(model, NO_EOS)
    params = SamplingParams()
    batched = engine.generate_window_sync([seq(p, seed=i) for i, p in enumerate(PROMPTS)], 10, params)
    alone = engine.generate_window_sync([seq(PROMPTS[2], seed=2)], 10, params)[0]
    assert batched[2].token_ids.tolist() == alone.token_ids.tolist()


def test_seeds_differ_and_repeat(tiny):
    model, _ = tiny
    engine = engine_for(model, NO_EOS)
    a = engine.generate_window_sync([seq(PROMPTS[0], seed=1)], 16, SamplingParams())[0]
    b = engine.generate_window_sync([seq(PROMPTS[0], seed=1)], 16, SamplingParams())[0]
    c = engine.generate_window_sync([seq(PROMPTS[0], seed=2)], 16, SamplingParams())[0]
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert a.token_ids.tolist() != c.token_ids.tolist()


def test_stops_on_eos_and_max_length(tiny):
    model, _ = tiny
    engine = engine_for(model, NO_EOS)
    probe = engine.generate_window_sync([seq(PROMPTS[0], seed=4)], 12, SamplingParams())[0]
    # Declare the 5th sampled token an EOS: generation stops right there, the EOS included.
    eos_engine = engine_for(model, (int(probe.token_ids[4]),))
    first = list(probe.token_ids).index(probe.token_ids[4])
    stopped = eos_engine.generate_window_sync([seq(PROMPTS[0], seed=4)], 12, SamplingParams())[0]
    assert stopped.finish_reason is FinishReason.EOS
    assert stopped.token_ids.tolist() == probe.token_ids[: first + 1].tolist()
    # A response budget of 7 with 4 already generated: 3 tokens, then MAX_LENGTH.
    capped = engine.generate_window_sync(
        [seq(PROMPTS[0], probe.token_ids[:4].tolist(), seed=4, max_tokens=7)], 12, SamplingParams()
    )[0]
    assert capped.finish_reason is FinishReason.MAX_LENGTH
    assert capped.token_ids.tolist() == probe.token_ids[4:7].tolist()
    with pytest.raises(ValueError, match="budget"):
        engine.generate_window_sync([seq(PROMPTS[0], [3] * 7, max_tokens=7)], 4, SamplingParams())


def test_update_weights_changes_outputs_and_version(tiny):
    _, tok = tiny
    model = build_tiny_model(ModelConfig(source="tiny", seed=3), len(tok))
    other = build_tiny_model(ModelConfig(source="tiny", seed=4), len(tok))
    engine = engine_for(model, NO_EOS)
    before = engine.generate_window_sync([seq(PROMPTS[1])], 16, SamplingParams(greedy=True))[0]
    engine.update_weights(other.named_parameters(), version=5)
    after = engine.generate_window_sync([seq(PROMPTS[1])], 16, SamplingParams(greedy=True))[0]
    ref = engine_for(other, NO_EOS).generate_window_sync([seq(PROMPTS[1])], 16, SamplingParams(greedy=True))[0]
    assert engine.weight_version == 5
    assert after.token_ids.tolist() == ref.token_ids.tolist() != before.token_ids.tolist()
    with pytest.raises(KeyError, match="nonexistent"):
        engine.update_weights([("nonexistent", torch.zeros(1))], 6)


def test_async_generate_window(tiny):
    model, _ = tiny
    engine = engine_for(model, NO_EOS)
    outs = asyncio.run(engine.generate_window([seq(p) for p in PROMPTS], 4, SamplingParams()))
    assert [len(o.token_ids) for o in outs] == [4, 4, 4, 4]


# --- sampling functions --------------------------------------------------------------------------


def test_counter_uniform_is_a_function_of_seed_and_position():
    u = counter_uniform(torch.tensor([1, 1, 2, 1]), torch.tensor([5, 5, 5, 6]))
    assert u[0] == u[1] and u[0] != u[2] and u[0] != u[3]
    assert 0 < float(u.min()) and float(u.max()) < 1
    # Roughly uniform: mean 0.5, variance 1/12.
    big = counter_uniform(torch.arange(100_000), torch.zeros(100_000, dtype=torch.long))
    assert abs(float(big.mean()) - 0.5) < 0.005 and abs(float(big.var()) - 1 / 12) < 0.002


def test_sampling_draws_from_the_distribution_and_never_a_zero_probability_token():
    probs = torch.tensor([0.5, 0.3, 0.0, 0.15, 0.05, 0.0])
    n = 40_000
    logprobs = torch.log(probs).expand(n, -1)
    tokens, token_lp = sample_from_logprobs(logprobs, torch.arange(n), torch.full((n,), 3))
    freq = torch.bincount(tokens, minlength=6).double() / n
    np.testing.assert_allclose(freq.numpy(), probs.numpy(), atol=0.01)
    assert freq[2] == 0 and freq[5] == 0
    torch.testing.assert_close(token_lp, torch.log(probs)[tokens])
    # A row's draw depends on its own (seed, position) only, not on the rows beside it.
    alone, _ = sample_from_logprobs(logprobs[:1], torch.tensor([7]), torch.tensor([3]))
    assert int(alone) == int(tokens[7])


def test_sampling_from_logits_is_the_draw_from_the_log_softmax():
    """The engine's fast path (no top-k/top-p) against the general one on the same (seed, position)."""
    logits = torch.randn(256, 5000, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, 7] = float("-inf")  # a token held back (EOS before the minimum length)
    seeds, positions = torch.arange(256), torch.arange(256) % 9
    fast, fast_lp = sample_from_logits(logits, 0.7, seeds, positions)
    slow, slow_lp = sample_from_logprobs(filtered_logprobs(logits, 0.7), seeds, positions)
    same = fast == slow  # only a draw within float32 rounding of an interval boundary may differ
    assert float(same.float().mean()) >= 0.99 and not bool((fast == 7).any())
    torch.testing.assert_close(fast_lp[same], slow_lp[same], atol=2e-5, rtol=0)
    # Its draws follow the distribution (the case of the general sampler's test).
    probs = torch.tensor([0.5, 0.3, 0.0, 0.15, 0.05, 0.0])
    n = 40_000
    tokens, token_lp = sample_from_logits(torch.log(probs).expand(n, -1), 1.0, torch.arange(n), torch.full((n,), 3))
    np.testing.assert_allclose((torch.bincount(tokens, minlength=6).double() / n).numpy(), probs.numpy(), atol=0.01)
    torch.testing.assert_close(token_lp, torch.log(probs)[tokens])


def test_top_k_top_p_filtering_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # top_p=0.7: 0.5 then 0.3 reaches 0.8 >= 0.7, so two tokens remain, renormalised.
    lp = filtered_logprobs(logits, 1.0, top_p=0.7)
    np.testing.assert_allclose(lp.exp().numpy(), [[0.625, 0.375, 0, 0]], atol=1e-6)
    lp = filtered_logprobs(logits, 1.0, top_k=3)
    np.testing.assert_allclose(lp.exp().numpy(), [[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]], atol=1e-6)
    # A vanishing top_p keeps exactly the most likely token (fuzzing found NaNs here: rounding in
    # the cumulative sum removed the first token too).
    wide = torch.randn(3, 49152) * 3
    lp = filtered_logprobs(wide, 1.0, top_p=5e-324)
    assert torch.isfinite(lp.max(dim=-1).values).all()
    assert torch.equal(lp.argmax(-1), wide.argmax(-1)) and int(torch.isfinite(lp).sum()) == 3


def test_fire_first_token_uses_hot_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.05, 0.05]] * 2))
    lp = step_logprobs(logits, torch.tensor([0, 3]), 1.0, first_token_temperature=1e6, first_token_top_k=2)
    np.testing.assert_allclose(lp[0].exp().numpy(), [0.5, 0.5, 0, 0], atol=1e-4)  # ~uniform over top-2
    np.testing.assert_allclose(lp[1].exp().numpy(), [0.7, 0.2, 0.05, 0.05], atol=1e-6)


def test_fire_empirical_first_token_near_uniform_and_rest_regular(tiny):
    model, _ = tiny
    engine = engine_for(model, NO_EOS)
    hot = SamplingParams(first_token_temperature=1e4, first_token_top_k=4)
    outs = engine.generate_window_sync([seq(PROMPTS[0], seed=s) for s in range(400)], 2, hot)
    counts = np.bincount([int(o.token_ids[0]) for o in outs], minlength=30)
    nonzero = counts[counts > 0]
    assert len(nonzero) == 4
    chi2 = float(((nonzero - 100) ** 2 / 100).sum())
    assert chi2 < 16.3  # chi-square, 3 dof, p = 0.001
    # With T_hot == T, FIRE is regular sampling (same seed, same outputs).
    same = SamplingParams(first_token_temperature=1.0, first_token_top_k=0)
    a = engine.generate_window_sync([seq(PROMPTS[0], seed=9)], 8, same)[0]
    b = engine.generate_window_sync([seq(PROMPTS[0], seed=9)], 8, SamplingParams())[0]
    assert a.token_ids.tolist() == b.token_ids.tolist()


def test_min_response_tokens_hold_eos_back_and_the_long_tail_workload_is_by_seed(tiny):
    from asyncrl.engines.base import long_tail_min_tokens

    model, _ = tiny
    engine = engine_for(model, eos=tuple(range(15)))  # half the vocabulary ends a response
    free = engine.generate_window_sync([seq(PROMPTS[0], seed=s) for s in range(40)], 32, SamplingParams())
    assert np.median([len(o.token_ids) for o in free]) <= 3
    held = [SequenceInput(prompt_ids=int32_array(PROMPTS[0]), response_ids=int32_array([]), seed=s,
                          max_response_tokens=64, min_response_tokens=12) for s in range(40)]
    outs = engine.generate_window_sync(held, 32, SamplingParams())
    for o in outs:
        assert len(o.token_ids) >= 12 and all(int(t) >= 15 for t in o.token_ids[:12])
        # The log-probs are those of the distribution sampled from (EOS masked): finite, and
        # higher than the unmasked ones.
        assert np.isfinite(o.logprobs).all()
    # Continuation from 10 generated tokens: only 2 more must be held back.
    cont = engine.generate_window_sync([SequenceInput(prompt_ids=int32_array(PROMPTS[0]), response_ids=outs[0].token_ids[:10],
                                                      seed=0, max_response_tokens=64, min_response_tokens=12)], 32, SamplingParams())[0]
    assert cont.token_ids[:2].tolist() == outs[0].token_ids[10:12].tolist()

    floors = [long_tail_min_tokens(s, 0.1, 80) for s in range(5000)]
    assert set(floors) == {0, 80} and abs(np.mean(np.array(floors) == 80) - 0.1) < 0.015
    assert floors == [long_tail_min_tokens(s, 0.1, 80) for s in range(5000)]  # a regenerated sample is the same
    assert long_tail_min_tokens(3, 0.0, 80) == 0 and long_tail_min_tokens(3, 1.0, 80) == 80


def test_stream_window_yields_the_window_token_by_token_and_stops_when_closed(tiny):
    model, _ = tiny
    params = SamplingParams(temperature=1.0)
    sequences = [seq(p, seed=40 + i, max_tokens=10) for i, p in enumerate(PROMPTS)]
    engine = engine_for(model, eos=(1, 2, 3))  # common tokens: some rows end early
    whole = engine.generate_window_sync(sequences, 10, params)

    async def collect(stop_after=None):
        steps = []
        stream = engine.stream_window(sequences, 10, params)
        async for step in stream:
            steps.append(step)
            if stop_after is not None and len(steps) == stop_after:
                await stream.aclose()
                break
        return steps

    steps = asyncio.run(collect())
    for row, out in enumerate(whole):
        items = [item for step in steps for item in step if item[0] == row]
        assert [t for _, t, _, _, _ in items] == out.token_ids.tolist()  # the same sample, one token per step
        np.testing.assert_allclose([lp for _, _, lp, _, _ in items], out.logprobs, atol=1e-6)
        assert [f for _, _, _, f, _ in items[:-1]] == [None] * (len(items) - 1) and items[-1][3] is out.finish_reason
        assert all(top is None for *_, top in items)  # no alternatives unless asked for
    # Closed after two steps: the engine stops decoding and is free for the next call.
    assert len(asyncio.run(collect(stop_after=2))) == 2
    assert engine.generate_window_sync(sequences, 10, params)[0].token_ids.tolist() == whole[0].token_ids.tolist()


def test_top_logprobs_are_the_most_likely_tokens_of_the_distribution_sampled_from(tiny):
    """`top_logprobs=k` reports each position's k most likely tokens under the distribution the token
    was drawn from (temperature, top-k and top-p applied), as a teacher-forced pass computes it; the samples
    are the same as without it, and the stream reports the same alternatives."""
    model, _ = tiny
    engine = engine_for(model, NO_EOS)
    k = 5
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=3, top_logprobs=k)  # top-k < k: some cannot be drawn
    sequences = [seq(p, seed=20 + i) for i, p in enumerate(PROMPTS)]
    outs = engine.generate_window_sync(sequences, 10, params)
    plain = engine.generate_window_sync(sequences, 10, SamplingParams(temperature=0.7, top_p=0.9, top_k=3))
    for prompt, out, same in zip(PROMPTS, outs, plain):
        assert out.token_ids.tolist() == same.token_ids.tolist() and same.top_ids is None
        assert out.top_ids.shape == out.top_logprobs.shape == (len(out.token_ids), k)
        ids = torch.tensor([prompt + out.token_ids.tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        reference = filtered_logprobs(logits, 0.7, 3, 0.9)  # [N, V]
        expected = torch.topk(reference, k, dim=-1)
        finite = torch.isfinite(expected.values).numpy()
        assert finite[:, 0].all() and not finite[:, 3:].any()  # top-k left the 4th and 5th out
        np.testing.assert_allclose(out.top_logprobs[finite], expected.values.numpy()[finite], atol=1e-4)
        assert (out.top_ids[finite] == expected.indices.numpy()[finite]).all()
        assert np.isneginf(out.top_logprobs[~finite]).all()  # a token that cannot be drawn, reported as such
        for j, token in enumerate(out.token_ids.tolist()):  # the sampled token's log-prob is its alternative's
            listed = out.top_ids[j].tolist()
            if token in listed:
                assert out.top_logprobs[j][listed.index(token)] == out.logprobs[j]

    async def stream():
        return [item for step in [s async for s in engine.stream_window(sequences, 10, params)] for item in step]

    items = asyncio.run(stream())
    for row, out in enumerate(outs):
        tops = [top for r, *_, top in items if r == row]
        assert [ids for ids, _ in tops] == out.top_ids.tolist()
        np.testing.assert_allclose([lps for _, lps in tops], out.top_logprobs, atol=1e-6)


def test_choice_seeds_are_a_hash_of_seed_and_index():
    from asyncrl.algo.sampling import choice_seed

    seeds = {s: [choice_seed(s, k) for k in range(16)] for s in range(200)}
    flat = [x for row in seeds.values() for x in row]
    assert len(set(flat)) == len(flat)  # no two (seed, index) pairs share a sampling seed
    assert all(0 <= x < 1 << 63 for x in flat)  # an int64 for the sampler
    assert seeds[42] == [choice_seed(42, k) for k in range(16)]  # the same request, the same choices
