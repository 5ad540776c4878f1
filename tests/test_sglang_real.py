"""SGLang for real (`engine=sglang_cpu`): one SGLang engine on a tiny random Qwen2 that this module
saves with transformers, checked against the learner's own log-probs for the same tokens
(`asyncrl.learning.scoring.response_logprobs`, the function the learner scores with).

Needs SGLang, which has an environment of its own: `make test-sglang` builds .venv-sglang (`make
sglang`) and runs this module there. The engine starts once for the module (about a minute of CPU);
tests that load weights look every token's weights up by the version SGLang reports for it, so each
test holds alone and in any order. The routing-replay test runs a second engine, on a tiny
mixture-of-experts model, in a process of its own.
"""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang in its own environment: `make test-sglang` (builds .venv-sglang with `make sglang` "
                "and runs .venv-sglang/bin/python -m pytest tests/test_sglang_real.py)", allow_module_level=True)

from asyncrl.config import compose  # noqa: E402
from asyncrl.engines.base import SamplingParams  # noqa: E402
from asyncrl.engines.generation import sequence_input  # noqa: E402
from asyncrl.learning.scoring import LOGPROB_FLOOR  # noqa: E402
from asyncrl.messages.structs import FinishReason  # noqa: E402
from real_engine_checks import (  # noqa: E402
    check_a_lora_version_is_merged_into_the_base, check_deltas_change_the_version_the_generator_holds,
    EOS, PROMPTS, TOLERANCE, check_a_dropped_row_stops_and_the_others_go_on_with_penalties_and_bias,
    check_against_learner, check_an_update_mid_request_lands_at_once, check_greedy_windows_take_the_learners_argmax,
    check_streams_carry_the_learners_logprobs_across_an_update,
    check_the_generator_role_loads_versions_before_and_while_it_runs, check_the_policy_endpoint_answers,
    check_top_k_top_p_logprobs_are_the_truncated_distributions, check_windows_carry_the_learners_logprobs, generate,
    learner_logprobs, load, loop, models, saved_tiny, started)
from tiny_hf_models import perturbed  # noqa: E402

assert loop and models  # fixtures of real_engine_checks: the module's event loop, its versions' models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model and the Hugging Face directory SGLang loads it from."""
    return saved_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(loop, tiny):
    from asyncrl.engines.sglang_launch import start_sglang

    config = compose(["engine=sglang_cpu", "model.source=hf", f"model.path={tiny[0]}", "engine.sglang_max_total_tokens=8192"])
    engine = started(loop, lambda: start_sglang(config.model, config.engine, seed=0))
    yield engine
    engine.shutdown()


def test_windows_carry_the_learners_logprobs(loop, engine, models):
    check_windows_carry_the_learners_logprobs(loop, engine, models)


def test_top_k_top_p_tokens_carry_the_logprob_of_the_truncated_distribution(loop, engine, models):
    check_top_k_top_p_logprobs_are_the_truncated_distributions(loop, engine, models)


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
    check_greedy_windows_take_the_learners_argmax(loop, engine, models)


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
    check_an_update_mid_request_lands_at_once(loop, engine, models)


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
    generator, paused = check_the_generator_role_loads_versions_before_and_while_it_runs(loop, engine, models)
    assert generator.counters["weight_updates"] == 1 and paused < 30


# --- the policy endpoint on SGLang -------------------------------------------------------------------


def test_the_endpoint_streams_sglangs_tokens_with_the_learners_logprobs_across_an_update(loop, engine, models):
    check_streams_carry_the_learners_logprobs_across_an_update(loop, engine, models)


def test_a_dropped_row_is_aborted_and_the_others_go_on_with_penalties_and_bias(loop, engine):
    check_a_dropped_row_stops_and_the_others_go_on_with_penalties_and_bias(loop, engine)


def test_the_policy_endpoint_answers_from_sglang(loop, engine, tiny):
    # SGLang honours a request's seed only in its deterministic mode (which turns its radix cache off
    # on this backend), so the plain answer and the stream are two samples: each is whole and its own.
    check_the_policy_endpoint_answers(loop, engine, tiny, ["engine=sglang_cpu"])


# Last: it leaves SGLang's weights LoRA-merged, which the tests above do not expect.
def test_a_lora_version_is_merged_into_the_base_and_its_tokens_are_the_learners(loop, engine, models):
    check_a_lora_version_is_merged_into_the_base(loop, engine, models)


def test_deltas_change_the_version_the_generator_holds(loop, engine, models):
    check_deltas_change_the_version_the_generator_holds(loop, engine, models)


# A mixture-of-experts model on an SGLang engine of its own process (`Engine.shutdown` ends every child
# of its process: this module's engine's too): two windows at most per response as the generator's
# `_advance` makes them, each sample's segments merged and sent back as the wire encodes them. In the
# first window a weight update (the same weights, as version 1) cuts the requests a few tokens in, as
# the learner's updates do: the cut requests continue under version 1.
MOE_WINDOWS = """
import asyncio, json, sys, time
import torch
from transformers import AutoModelForCausalLM
from asyncrl.assembly.rows import merge_segments
from asyncrl.config import compose
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import sequence_input
from asyncrl.engines.sequences import GeneratedSequence, window_segment
from asyncrl.engines.sglang_launch import start_sglang
from asyncrl.messages.structs import FinishReason, PromptRequest, Segment, int32_array
from asyncrl.messages.wire import Codec
async def main(directory, prompts, path):
    config = compose(["engine=sglang_cpu", "model.source=hf", f"model.path={directory}",
                      "engine.sglang_max_total_tokens=2048"])
    engine = start_sglang(config.model, config.engine, seed=0)
    running = [GeneratedSequence(PromptRequest(prompt_id=f"p{i}", prompt_token_ids=int32_array(p), group_size=1,
                                               seed=90 + i), 0) for i, p in enumerate(prompts)]
    samples = {s.request.prompt_id: [] for s in running}
    weights = list(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).named_parameters())
    params = SamplingParams(temperature=1.0)
    try:
        start = time.perf_counter()  # a warm-up window of 4 tokens: how long a token takes here
        await engine.generate_window([sequence_input(s.request.prompt_token_ids, seed=7, max_response_tokens=4)
                                      for s in running], 4, params)
        per_token = (time.perf_counter() - start) / 4
        for window in range(2):
            pending = asyncio.ensure_future(engine.generate_window(
                [sequence_input(s.request.prompt_token_ids, seed=s.request.seed, max_response_tokens=24,
                                response_ids=s.response_ids) for s in running], 12, params))
            if window == 0:
                await asyncio.sleep(4 * per_token)
                await asyncio.to_thread(engine.update_weights, weights, 1)
            outs = await pending
            for seq, out in zip(list(running), outs):
                done = out.finished or window == 1
                segment = window_segment(seq, "g0", out.token_ids, out.logprobs, out.versions, out.scored, out.routes,
                                         done, FinishReason.MAX_LENGTH if done and not out.finished else out.finish_reason)
                samples[seq.request.prompt_id].append(segment)
                running.remove(seq) if done else seq.extend(segment, False)
    finally:
        engine.shutdown()
    with open(path, "wb") as f:
        f.write(Codec(list[Segment]).encode([merge_segments(s) for s in samples.values()]))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]))
"""


@pytest.mark.slow  # its own engine (~2 min on 2 cores): `make test-sglang-slow`; the conversion: tests/test_routes_travel.py
def test_a_moe_models_routes_are_each_tokens_top_k_and_the_learner_replays_them(tmp_path):
    """Routing replay on SGLang (`--enable-return-routed-experts`; on CPU through sglang_cpu/'s
    plugin): a tiny random Qwen3-MoE (8 experts, top-2, 2 layers, float32), windows as a generator
    advances them (`MOE_WINDOWS`). Each token's route is the top-2 set transformers' router chooses in
    float32 at the position the token was sampled from; the samples pass the learner's route check
    and, replayed, give SGLang's log-probs. A weight update cuts the first window's requests a few
    tokens in: SGLang 0.5.23 returns an aborted request's routes with its tokens, so every token is
    routed across the cut, before it and after (a record of another length would leave its tokens
    `UNROUTED`, for the learner to route: `sglang_engine.take_output`)."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from asyncrl.learning.routing import refuse_misfit_routes, route_shape
    from asyncrl.learning.tensors import collate
    from asyncrl.messages.routes import routed_tokens
    from asyncrl.messages.structs import Segment, TrainingRow
    from asyncrl.messages.wire import Codec
    from test_routing_replay import learner_logprobs, max_gap, save_moe_directory

    directory, path = save_moe_directory(tmp_path / "tiny-moe"), tmp_path / "segments"
    done = subprocess.run([sys.executable, "-c", MOE_WINDOWS, directory, json.dumps(PROMPTS[:4]), str(path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    rows, same, pairs, unrouted, spanning = [], 0, 0, 0, 0
    for segment in Codec(list[Segment]).decode(path.read_bytes()):
        prompt, response = segment.prompt_token_ids.tolist(), segment.new_token_ids.tolist()
        assert segment.new_routes.dtype == np.uint8 and segment.new_routes.shape == (len(response), 2, 2)
        spanning += set(segment.new_versions.tolist()) == {0, 1}
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response]), output_router_logits=True).router_logits
        at = slice(len(prompt) - 1, len(prompt) - 1 + len(response))  # the positions the tokens were sampled from
        router = torch.stack([torch.topk(layer.float(), 2, dim=-1).indices[at] for layer in logits], dim=1)
        routed = routed_tokens(segment.new_routes)
        unrouted += int((~routed).sum())
        agree = (np.sort(router.numpy(), -1) == np.sort(segment.new_routes, -1)).all(-1)[routed]
        same, pairs = same + int(agree.sum()), pairs + agree.size
        rows.append(TrainingRow(segment=segment, score=1.0, advantages=np.zeros(len(response), np.float32)))
    print(f"SGLang's routes are transformers' float32 top-2 on {same}/{pairs} (token, layer) pairs; "
          f"{unrouted} tokens unrouted; {spanning} samples across the update")
    assert spanning and unrouted == 0 and same >= 0.95 * pairs and pairs >= 2 * 4 * 4
    kept, refused = refuse_misfit_routes(rows, route_shape(model))
    assert refused == []
    collated = collate(kept)
    assert max_gap(learner_logprobs(model, collated, replay=True), collated) < TOLERANCE


# SGLang's engine on an export, in a process of its own as a user starts it (this module's engine
# stays as it is): greedy tokens of each prompt, and their text through the export's tokenizer.
SERVE_EXPORT = """
import json, os, sys
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
import sglang
directory, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
engine = sglang.Engine(model_path=directory, device="cpu", dtype="float32", max_total_tokens=4096, random_seed=0,
                       log_level="error")
try:
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
    print("RESULT " + json.dumps([[o["output_ids"], o["text"]] for o in outs]))
finally:
    engine.shutdown()
"""


def test_an_exported_run_loads_in_sglang_and_generates_transformers_greedy_tokens(tmp_path):
    """`asyncrl export` of a learner's checkpoint (the tiny Llama after an optimizer step, written by
    the policy learner's own checkpoint code, in this process: no Ray beside SGLang here) is a
    directory SGLang's engine loads as it is and generates from: its greedy tokens are those of
    transformers' `generate` on the same directory, and it decodes them with the export's tokenizer."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.policy_learner import CheckpointPolicy, build_policy_learner
    from asyncrl.bench.learner import synthetic_batch
    from asyncrl.cli import main
    from asyncrl.messages.mailbox import InProcessMailbox

    run, export = tmp_path / "run", tmp_path / "export"
    config = compose(["model=tiny", "task=tiny", "policy.optimizer.lr=0.02"])
    learner = build_policy_learner(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0,
                                   InProcessMailbox(2), checkpoints=CheckpointPolicy(str(run)))
    learner.policy.step(synthetic_batch(4, 6, 6, learner.model.config.vocab_size))
    learner.step = learner.weight_version = 1
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(learner.save_checkpoint())
    finally:
        loop.close()
    assert main(["export", str(run), str(export)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    prompts = [tokenizer(text)["input_ids"] for text in ("3:", "7:", "12:", "0:45")]
    new_tokens = 12
    expected = []
    for ids in prompts:  # EOS does not stop either side: every prompt has its 12 tokens to compare
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False, eos_token_id=[],
                             pad_token_id=tokenizer.pad_token_id)
        expected.append(out[0, len(ids):].tolist())
    assert all(len(e) == new_tokens for e in expected)
    done = subprocess.run([sys.executable, "-c", SERVE_EXPORT, str(export), json.dumps(prompts), str(new_tokens)],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    served = json.loads(lines[-1].removeprefix("RESULT "))
    assert [ids for ids, _ in served] == expected
    assert [text for _, text in served] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
