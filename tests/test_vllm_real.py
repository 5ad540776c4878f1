"""vLLM for real (`engine=vllm`): one vLLM engine (its CPU build) on a tiny random Qwen2 that this
module saves with transformers, checked against the learner's own log-probs for the same tokens
(`asyncrl.learning.scoring.response_logprobs`, the function the learner scores with).

Needs vLLM, which has an environment of its own: `make test-vllm` builds .venv-vllm (`make vllm`)
and runs this module there. The engine starts once for the module (about a minute of CPU); tests
that load weights look every token's weights up by the version the engine gave it, so each test
holds alone and in any order.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM in its own environment: `make test-vllm` (builds .venv-vllm with `make vllm` "
                "and runs .venv-vllm/bin/python -m pytest tests/test_vllm_real.py)", allow_module_level=True)

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
    learner_logprobs, load, loop, models, saved_tiny, started, stream_rows)
from tiny_hf_models import perturbed  # noqa: E402

assert loop and models  # fixtures of real_engine_checks: the module's event loop, its versions' models
HIDDEN = 128  # four heads of 32: a head size vLLM's CPU attention takes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model and the Hugging Face directory vLLM loads it from."""
    return saved_tiny(tmp_path_factory, hidden_size=HIDDEN)


@pytest.fixture(scope="module")
def engine(loop, tiny):
    from asyncrl.engines.vllm_launch import start_vllm

    config = compose(["engine=vllm", "model.source=hf", f"model.path={tiny[0]}", "engine.vllm_kv_cache_mb=64"])
    engine = started(loop, lambda: start_vllm(config.model, config.engine, seed=0))
    yield engine
    engine.shutdown()


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


def test_a_model_vllm_cannot_load_is_refused_in_one_line_with_vllms_reason(loop, tmp_path):
    """GPT-Neo (EleutherAI's gpt-neo-125M, say): transformers, and so the learner, loads it; vLLM has
    no implementation of it and its Transformers backend cannot run it (no attention interface).
    vLLM's refusal (a pydantic `ValidationError` of many lines, ending in every architecture it
    knows) becomes one line naming the directory and vLLM's reason. Fails in seconds, before any
    vLLM process starts."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig, GPTNeoForCausalLM

    from asyncrl.config import ConfigError
    from asyncrl.engines.vllm_launch import start_vllm
    from asyncrl.models.loading import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    GPTNeoForCausalLM(GPTNeoConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_layers=2, num_heads=4,
                                   attention_types=[[["global", "local"], 1]], max_position_embeddings=1024,
                                   eos_token_id=tokenizer.eos_token_id)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "GPTNeoForCausalLM"
    config = compose(["engine=vllm", "model.source=hf", f"model.path={tmp_path}", "engine.vllm_kv_cache_mb=64"])
    with pytest.raises(ConfigError) as refused:
        started(loop, lambda: start_vllm(config.model, config.engine, seed=0))
    message = str(refused.value)
    assert "\n" not in message and len(message) < 300, message
    assert message == (f"engine=vllm: vLLM cannot start on the model directory {tmp_path}: "
                       "Model architectures ['GPTNeoForCausalLM'] are not supported for now.")


def test_windows_carry_the_learners_logprobs(loop, engine, models):
    check_windows_carry_the_learners_logprobs(loop, engine, models)


def test_more_prompt_tokens_than_one_step_takes_prefill_whole_and_keep_their_seeds(loop, engine, models):
    """64 seeded rows of 120-token prompts: more prompt tokens than vLLM schedules in one step. With
    vLLM's chunked prefill a seeded request split across steps kills its CPU worker (it rewinds the
    request's generator by an offset, which CPU generators lack: "CPU Generator does not use
    offset"); asyncrl turns chunked prefill off on CPU, so each prompt is prefilled whole."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 30, size=120).tolist() for _ in range(64)]
    sequences = [sequence_input(p, seed=i, max_response_tokens=4) for i, p in enumerate(prompts)]
    outputs = generate(loop, engine, sequences, 4, SamplingParams(temperature=1.0))
    assert len(outputs) == 64 and all(len(out.token_ids) >= 1 for out in outputs)
    for prompt, out in list(zip(prompts, outputs))[::16]:
        check_against_learner(models, prompt, out, 1.0)


def test_a_seed_draws_the_same_tokens_and_another_seed_others(loop, engine):
    params = SamplingParams(temperature=1.0)
    again = [generate(loop, engine, [sequence_input(PROMPTS[1], seed=s, max_response_tokens=24)], 24, params)[0]
             for s in (7, 7, 8)]
    assert again[0].token_ids.tolist() == again[1].token_ids.tolist()
    assert again[0].token_ids.tolist() != again[2].token_ids.tolist()


def test_top_k_top_p_tokens_carry_the_logprob_of_the_truncated_distribution(loop, engine, models):
    # vLLM's processed log-probs: renormalised after the cut.
    check_top_k_top_p_logprobs_are_the_truncated_distributions(loop, engine, models)


def test_greedy_windows_take_the_learners_argmax(loop, engine, models):
    check_greedy_windows_take_the_learners_argmax(loop, engine, models)


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
    check_an_update_mid_request_lands_at_once(loop, engine, models)


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
    generator, paused = check_the_generator_role_loads_versions_before_and_while_it_runs(loop, engine, models,
                                                                                          from_start=True)
    assert generator.counters["weight_updates"] == 1 and paused < 30


# --- the policy endpoint on vLLM ----------------------------------------------------------------------


def test_the_endpoint_streams_vllms_tokens_with_the_learners_logprobs_across_an_update(loop, engine, models):
    check_streams_carry_the_learners_logprobs_across_an_update(loop, engine, models)


def test_a_dropped_row_is_aborted_and_the_others_go_on_with_penalties_and_bias(loop, engine):
    check_a_dropped_row_stops_and_the_others_go_on_with_penalties_and_bias(loop, engine)


def test_a_streamed_row_takes_min_p_and_its_alternatives_are_the_sampled_distributions(loop, engine, models):
    """A request's min-p (vLLM's own) and top log-probs on the endpoint's stream: every token is in
    the min-p set with that set's renormalised log-prob, and its alternatives, most likely first,
    are that distribution's (-inf past the cut); the same seed streams the same tokens."""
    from asyncrl.algo.sampling import filtered_logprobs

    params = SamplingParams(temperature=1.0, min_p=0.3, top_logprobs=4)
    sequences = [sequence_input(p, seed=150 + i, max_response_tokens=16) for i, p in enumerate(PROMPTS[:3])]
    rows, _ = stream_rows(loop, engine, sequences, params)
    again, _ = stream_rows(loop, engine, sequences, params)
    model = models[engine.weight_version]
    for i, prompt in enumerate(PROMPTS[:3]):
        tokens = [s.token for s in rows[i]]
        assert tokens == [s.token for s in again[i]]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        expected = filtered_logprobs(logits, 1.0, min_p=0.3)
        sampled = expected.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        assert torch.isfinite(sampled).all(), "a token below min-p was drawn"
        np.testing.assert_allclose([s.logprob for s in rows[i]], sampled.numpy(), atol=TOLERANCE, rtol=0)
        best = torch.topk(expected, 4, dim=-1)
        for row, step in enumerate(rows[i]):
            ids, logprobs = step.top
            finite = np.isfinite(logprobs)
            np.testing.assert_allclose(np.asarray(logprobs)[finite], best.values[row][finite].numpy(), atol=TOLERANCE)
            assert set(np.asarray(ids)[finite].tolist()) == set(best.indices[row][finite].tolist())


def test_a_lora_version_is_merged_into_the_base_and_its_tokens_are_the_learners(loop, engine, models):
    check_a_lora_version_is_merged_into_the_base(loop, engine, models, hidden_size=HIDDEN)


def test_deltas_change_the_version_the_generator_holds(loop, engine, models):
    check_deltas_change_the_version_the_generator_holds(loop, engine, models, hidden_size=HIDDEN)


def test_the_policy_endpoint_answers_from_vllm(loop, engine, tiny):
    plain, entries = check_the_policy_endpoint_answers(loop, engine, tiny, ["engine=vllm",
                                                                            "engine.vllm_kv_cache_mb=64"])
    # vLLM takes a request's seed: the plain answer and the stream are the same sample.
    assert [e["token"] for e in plain["choices"][0]["logprobs"]["content"]] == [e["token"] for e in entries]


@pytest.mark.slow  # an engine of its own: a minute of start-up (`make test-vllm-slow`)
def test_the_policy_app_builds_vllm_for_a_vllm_run(tiny):
    """`engine=vllm` gives the `policy` application vLLM's engine, never the embedded one."""
    from asyncrl.serve.policy_engine import ServerPolicy, build_policy_engine

    config = compose(["engine=vllm", "model.source=hf", f"model.path={tiny[0]}", "engine.vllm_kv_cache_mb=64",
                      "serve.follow_learner=false"])
    policy = build_policy_engine(config)
    try:
        assert isinstance(policy, ServerPolicy) and type(policy.engine).__name__ == "VLLMEngine"
        assert policy.max_positions == policy.engine.kv_positions < (1 << 62)
    finally:
        policy.engine.shutdown()


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


@pytest.mark.slow  # a run of its own: ~2 minutes (`make test-vllm-slow`)
def test_a_lora_run_sends_vllm_generators_adapters_merged_there(ray_session, tmp_path):
    """`model.lora_rank` with `engine=vllm`: the learner sends each version as its adapter (a few
    kilobytes, not the model), the generator merges it into the directory's base and loads the whole
    version into vLLM; the tokens of each step are scored as the learner's."""
    from asyncrl.driver import train

    config = compose(["engine=vllm", "model=tiny", "model.num_heads=2", "task=tiny", "algorithm=grpo",
                      "model.lora_rank=8", "model.lora_alpha=16", "engine.vllm_kv_cache_mb=64", "trainer.total_steps=3",
                      f"trainer.run_dir={tmp_path}", "trainer.wandb_mode=disabled"])
    summary = train(config, progress=False, eval_prompts=4)
    records = summary["records"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert summary["final_status"]["ledger"]["problems"] == []
    from asyncrl.models.loading import build_tiny_model, build_tiny_tokenizer

    model_bytes = 4 * sum(p.numel() for p in build_tiny_model(config.model, len(build_tiny_tokenizer())).parameters())
    assert all(0 < r["broadcast_bytes"] < model_bytes / 4 for r in records)  # adapters, never the model
    # Steps whose rows were all of the version the engine held score as the learner does.
    assert all(r["rollout_kl_k3"] < 1e-3 for r in records if r["staleness_max"] == 0)


def vllm_processes(pid: int) -> list:
    """vLLM's engine-core processes under a generator's (`VLLM::EngineCore`, as vLLM titles them)."""
    import psutil

    return [p for p in psutil.Process(pid).children(recursive=True)
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]


@pytest.mark.slow  # two vLLM start-ups: ~3 minutes (`make test-vllm-slow`)
def test_a_killed_vllm_engine_is_healed_by_the_pool(ray_session, tmp_path):
    """vLLM's engine-core process killed under a running generator: vLLM's error ends the
    generator's loop, the pool replaces the generator (a new one with a vLLM of its own) and the
    learner trains on, with no restart from a checkpoint and nothing lost or trained twice. Never
    a silent stall. With delta updates (`policy.weight_delta`): the new generator is sent a whole
    version to hold, then deltas from it."""
    import json
    import os
    import signal

    from asyncrl.run import Run
    from test_pool import assert_ledger_whole, learner_step, poll_until

    config = compose(["engine=vllm", "model=tiny", "model.num_heads=2", "task=tiny", "algorithm=grpo",
                      "engine.vllm_kv_cache_mb=64", "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0",
                      "policy.weight_delta=true", f"trainer.run_dir={tmp_path}"])
    run = Run(config, str(tmp_path)).start()
    try:
        poll_until(run, lambda: learner_step(run) >= 2, 240)
        cores = vllm_processes(run.pid("gen-0"))
        assert len(cores) == 1, cores
        os.kill(cores[0].pid, signal.SIGKILL)
        killed_at = learner_step(run)
        poll_until(run, lambda: "gen-1" in run.generator_ids and learner_step(run) >= killed_at + 2, 300)
        assert run.restarts == []  # healed in place
        events = [json.loads(line) for line in open(tmp_path / "generators.jsonl")]
        assert [(e["event"], e["generator"]) for e in events][:2] == [("removed", "gen-0"), ("joined", "gen-1")], events
        assert run.generator_ids == ["gen-1"] and len(vllm_processes(run.pid("gen-1"))) == 1
        assert "delta_elements" in run.role_stats("learner")["last_broadcast"]
        assert_ledger_whole(run)
    finally:
        run.stop()
