"""Multi-turn episodes with tools: where a turn ends, what the environment answers, and that the
trajectory a generator streams is token-exact (the tokens trained are the tokens sampled, the
observations are the environment's, turn by turn, with per-token versions)."""

import asyncio
import copy
import os

import numpy as np
import pytest
import ray
import torch

from actors.environment import environment_actor
from actors.generator import Generator
from asyncrl.assembly.rows import merge_segments
from asyncrl.config import EnvironmentConfig, ModelConfig
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.environments.episodes import EnvironmentClient, Episodes, LocalEnvironment
from asyncrl.environments.formats import ChatMLTools, Malformed, ToolCall, TinyTools
from asyncrl.environments.templates import ChatTemplate
from asyncrl.environments.tools import Episode, LookupTool, episode_secret
from asyncrl.learning.scoring import response_logprobs
from asyncrl.learning.tensors import collate
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.structs import (FinishReason, PromptRequest, Segment, TrainingRow, observation_mask, scored_mask,
                                      segment_row)
from asyncrl.models.loading import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def tiny_episodes(tok, max_turns=1, environment=None):
    return Episodes(TinyTools(), environment or LocalEnvironment(LookupTool()), tok, max_turns, 512)


def test_a_turn_ends_just_after_the_token_that_completes_the_call(tok):
    episodes = tiny_episodes(tok)  # the tiny format: a turn that starts with a non-digit asks
    assert episodes.call_end([], ids(tok, "ab?cd")) == 1  # "a" kept: the rest was sampled past the call
    assert episodes.call_end([], ids(tok, "7ab")) is None  # an answer
    assert episodes.call_end([], []) is None


@pytest.fixture(scope="module")
def smol(smol_tokenizer):
    return smol_tokenizer  # the embedded model's (SmolLM2, ChatML)


def test_a_chatml_call_split_over_windows_ends_at_its_last_token_and_its_answer_is_encoded_once(smol):
    """`</tool_call>` is five tokens of SmolLM2's vocabulary: a call completed in the second window
    keeps that window up to the token that completes it; the observation is the chat template's
    rendering encoded once (special tokens included), after the policy's tokens as sampled."""
    render = ChatTemplate(smol, ChatMLTools())
    episodes = Episodes(ChatMLTools(), LocalEnvironment(LookupTool()), smol, 2, 512, render)
    text = 'Sure. <tool_call>{"name": "lookup", "arguments": {}}</tool_call> and more'
    turn = smol.encode(text, add_special_tokens=False)
    end = next(k for k in range(len(turn)) if smol.decode(turn[:k]).endswith("</tool_call>"))
    first, second = turn[: end - 3], turn[end - 3:]  # the stop string straddles the two windows
    assert episodes.call_end([], first) is None
    assert episodes.call_end(first, second) == 3
    observation = asyncio.run(episodes.observe(turn[:end], Episode("p", 1)))
    assert observation.text == episode_secret("p", 1) and not observation.error
    assert observation.token_ids == smol.encode(render.observation(observation.text), add_special_tokens=False)
    assert observation.token_ids[0] == smol.convert_tokens_to_ids("<|im_end|>")  # a special token, not its text
    malformed = asyncio.run(episodes.observe(smol.encode('<tool_call>{"name": oops}</tool_call>',
                                                         add_special_tokens=False), Episode("p", 1)))
    assert malformed.malformed and malformed.text.startswith("error: the call is not JSON")


def test_chatml_calls_are_parsed_robustly():
    chatml = ChatMLTools()
    good = 'I will compute. <tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    assert chatml.parse(good) == ToolCall("python", {"code": "print(6*7)"})
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert chatml.parse(as_string) == ToolCall("python", {"code": "print(1)"})
    assert "not JSON" in chatml.parse('<tool_call>{"name": python}</tool_call>').reason
    assert "must begin with" in chatml.parse("print(1)</tool_call>").reason
    assert '"name"' in chatml.parse("<tool_call>[1, 2]</tool_call>").reason
    assert '"arguments"' in chatml.parse('<tool_call>{"name": "python", "arguments": 3}</tool_call>').reason
    assert isinstance(chatml.parse("no call"), Malformed)


def run_generator(generator: Generator, prompts: list[PromptRequest], segments, between=None) -> list:
    async def go():
        await generator.prompts.put(prompts)
        out, turns = [], 0
        while True:
            await generator.step()
            out += await segments.get(10_000, timeout=0.0)
            if between is not None:
                between(turns)
            turns += 1
            if not generator.held and not (await generator.prompts.stats()).queued and turns > 1:
                return out
    return asyncio.run(go())


def test_an_episode_is_token_exact_turn_by_turn_with_per_token_versions(tok):
    """A real generator runs tiny-tool episodes (tool calls the lookup environment answers) with a
    weight update landing between windows: every policy token's behaviour log-prob is the one the
    weights of its version give it in the context the learner sees (so the tokens trained are the
    tokens sampled, in that context); every observation is exactly the environment's answer encoded
    once, unscored, out of every loss; the segments of a sample join up window by window."""
    torch.manual_seed(0)
    model = build_tiny_model(ModelConfig(source="tiny", seed=5), len(tok))
    v0 = copy.deepcopy(model)
    engine = TorchEngine(model, eos_token_ids=(10_000,), pad_token_id=0)
    prompts, segments = InProcessMailbox(capacity=64), InProcessMailbox(capacity=100_000)
    generator = Generator(engine, prompts, segments, SamplingParams(temperature=1.0), window_tokens=2,
                          max_response_tokens=8, max_windows=0, max_inflight=64, episodes=tiny_episodes(tok, 2))
    requests = [PromptRequest(prompt_id=f"p{d}", prompt_token_ids=np.asarray(ids(tok, f"{d}:"), dtype=np.int32),
                              group_size=8, seed=100 * d, data_source="tiny_tool", ground_truth="episode")
                for d in range(4)]
    v1 = copy.deepcopy(model)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def update(turn):
        if turn == 1:  # between windows, as the learner's delivery lands
            engine.update_weights(list(v1.state_dict().items()), version=1)

    out = run_generator(generator, requests, segments, update)
    models = {0: v0, 1: v1}
    by_sample: dict[str, list] = {}
    for s in out:
        by_sample.setdefault(s.sample_id, []).append(s)
    assert len(by_sample) == 32
    calls = 0
    for sample_id, parts in by_sample.items():
        parts.sort(key=lambda s: s.window)
        for seg in parts:
            before = [p.new_token_ids for p in parts[: seg.window]]
            assert seg.prior_response_ids.tolist() == (np.concatenate(before).tolist() if before else [])
            observed, scored = observation_mask(seg), scored_mask(seg) > 0
            assert not (observed & scored).any()
            assert (seg.new_logprobs[observed] == 0).all()
            if observed.any():  # the call's window: "?" then the environment's answer, exactly
                calls += 1
                first = int(np.flatnonzero(observed)[0])
                assert not tok.decode(seg.new_token_ids[:first].tolist())[-1].isdigit()  # the call
                answer = episode_secret(seg.prompt_id, seg.sample_idx)
                assert seg.new_token_ids[first:].tolist() == ids(tok, TinyTools().observation(answer))
                assert seg.finish_reason is FinishReason.TOOL_CALL and not seg.finished
                assert (seg.new_versions[first:] == seg.new_versions[first - 1]).all()
            policy = ~observed
            for version in np.unique(seg.new_versions[policy]):
                at = policy & (seg.new_versions == version)
                expected = response_logprobs(models[int(version)], [segment_row(seg)], 1.0)[0]
                np.testing.assert_allclose(seg.new_logprobs[at], expected[at], atol=2e-5)
        merged = merge_segments(parts)
        batch = collate([TrainingRow(segment=merged, score=1.0, advantages=np.ones(len(merged.new_token_ids), np.float32),
                                     correct=True)])
        # The policy loss trains the scored policy tokens; the positive-example NLL every policy
        # token; neither an observation (the masks are placed token by token in order).
        placed = batch.targets[0][batch.nll_mask[0] > 0].tolist()
        assert placed == merged.new_token_ids[~observation_mask(merged)].tolist()
        placed = batch.targets[0][batch.response_mask[0] > 0].tolist()
        assert placed == merged.new_token_ids[scored_mask(merged) > 0].tolist()
    assert calls >= 10, calls  # two thirds of a random model's turns start with a non-digit: a call
    assert {int(v) for parts in by_sample.values() for s in parts for v in s.new_versions} == {0, 1}
    # Calls answered: those whose observation is in the context, and those the budget left no room
    # for (the episode ended at its call, the observation never entered the context).
    no_room = sum(s.finished and s.finish_reason is FinishReason.MAX_LENGTH and s.new_observation is None
                  and s.prior_observation is None and s.window == 0 and len(s.new_token_ids) == 1
                  for parts in by_sample.values() for s in parts)
    assert generator.counters["tool_calls"] == calls + no_room


def test_the_environment_endpoint_answers_times_out_and_runs_python_in_the_sandbox(ray_session):
    lookup = environment_actor(EnvironmentConfig(name="lookup", tool_format="tiny"))
    client = EnvironmentClient(lookup, timeout_s=5.0, retries=1)
    text, error = asyncio.run(client(ToolCall("lookup"), Episode("p3", 2)))
    assert (text, error) == (episode_secret("p3", 2), False)
    ray.get(lookup.reconfigure.remote({"fault_delay_s": 30.0}))  # hangs: timed out, retried, an error
    slow = EnvironmentClient(lookup, timeout_s=0.5, retries=1)
    text, error = asyncio.run(slow(ToolCall("lookup"), Episode("p3", 2)))
    assert error and "did not answer" in text and "2 tries" in text and slow.failures == 1
    python = environment_actor(EnvironmentConfig(name="python", allow_unisolated=True))
    client = EnvironmentClient(python, timeout_s=60.0, retries=0)
    assert asyncio.run(client(ToolCall("python", {"code": "print(6 * 7)"}), Episode("q", 0))) == ("42", False)
    text, error = asyncio.run(client(ToolCall("python", {"code": "raise ValueError('no')"}), Episode("q", 0)))
    assert error and "ValueError: no" in text
    text, error = asyncio.run(client(ToolCall("search", {}), Episode("q", 0)))
    assert error and "no tool named 'search'" in text
    for actor in (lookup, python):
        ray.kill(actor)


def test_the_critic_values_policy_positions_only_gae_carries_across_an_observation():
    """A response p p o o p (two policy tokens, a two-token observation, the answer), reward 1 at
    the end, γ = 1, λ = 0.5, V = 0.1, 0.2, (9, 9: never read), 0.4, then 0 after the last token.
    By hand over the policy positions alone (0.1, 0.2, 0.4; the observation is not an action):
    δ = 0.1, 0.2, 0.6; Â_2 = 0.6, Â_1 = 0.2 + 0.5·0.6 = 0.5, Â_0 = 0.1 + 0.5·0.5 = 0.35; the
    observation's advantages are 0 and out of every loss."""
    from asyncrl.assembly.rows import Outcome, value_rows
    from asyncrl.config import GAEAdvantage

    gae = GAEAdvantage(gamma=1.0, lam=0.5)
    observed = np.array([0, 0, 1, 1, 0], dtype=np.uint8)
    row = Segment(prompt_id="p", sample_idx=0, window=0, group_id="p", prompt_token_ids=np.array([5, 6], dtype=np.int32),
                  prior_response_ids=np.zeros(0, np.int32), prior_versions=np.zeros(0, np.int32),
                  new_token_ids=np.array([8, 9, 10, 11, 12], dtype=np.int32), new_logprobs=np.zeros(5, np.float32),
                  new_versions=np.zeros(5, np.int32), new_scored=1 - observed, new_observation=observed,
                  finished=True, finish_reason=FinishReason.EOS)
    values = np.array([0.1, 0.2, 9.0, 9.0, 0.4, 0.0], dtype=np.float32)
    (trained,) = value_rows([row], [values], [Outcome(1.0, True)], gae, window_tokens=8)
    np.testing.assert_allclose(trained.advantages, [0.35, 0.5, 0.0, 0.0, 0.6], atol=1e-6)
    assert collate([trained]).response_mask.sum() == 3  # the observation is never trained


def test_the_documented_environment_class_loads_by_its_path_and_answers(tmp_path):
    """docs/environments.md's complete example, as a user copies it into a file: built with its
    options from `environment.class_path`, and it answers calls (an error is an observation)."""
    import re

    from asyncrl.config import compose
    from asyncrl.environments.formats import ToolCall
    from asyncrl.environments.tools import Episode, build_environment

    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "environments.md")).read()
    (tmp_path / "my_env.py").write_text(re.findall(r"```python\n(.*?)```", doc, re.S)[1])
    config = compose(["model=tiny", "task=tiny_tool", "environment.name=",
                      f"environment.class_path={tmp_path}/my_env.py:Calculator", "environment.options={digits: 3}"])
    calculator = build_environment(config.environment)
    episode = Episode("p", 0)
    assert calculator.step(ToolCall("calculator", {"expression": "12 * 7"}), episode) == ("84", False)
    assert calculator.step(ToolCall("calculator", {"expression": "2 / 3"}), episode) == ("0.667", False)
    assert calculator.step(ToolCall("calculator", {"expression": "__import__('os')"}), episode)[1] is True
    assert calculator.calls == {("p", 0): 3}
    with pytest.raises(ValueError, match="has no class 'Calculatr'.*Calculator"):
        build_environment(compose(["model=tiny", "task=tiny_tool", "environment.name=",
                                   f"environment.class_path={tmp_path}/my_env.py:Calculatr"]).environment)


def test_a_tool_that_answers_with_an_image_gets_an_error_observation_saying_images_are_not_supported():
    """Observations are text. An environment whose step returns an image (a PIL screenshot, PNG
    bytes, a chat image part) or anything but (text, is_error) answers that call with an error
    observation saying what came back (`step_answer`, which the endpoint actor and the in-process
    environment both call); the episode goes on (the next call's text answer is taken)."""
    import io

    from PIL import Image

    from asyncrl.environments.tools import step_answer

    png, webp = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    Image.new("RGB", (4, 4)).save(webp, format="WEBP")
    wav = b"RIFF\x24\x00\x00\x00WAVEfmt "  # a RIFF container as WebP is, of sound

    class Screens:
        answers = [(Image.new("RGB", (8, 8)), False), (png.getvalue(), False),
                   ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}], False),
                   "just text", ("a screen of text", 0), (webp.getvalue(), False), (wav, False)]

        def step(self, call, episode):
            return self.answers[episode.sample_idx]

    call = ToolCall("screenshot", {})
    answers = [step_answer(Screens(), call, Episode("p", i)) for i in range(7)]
    for text, error in [*answers[:3], answers[5]]:
        assert error and "images from tools are not supported yet" in text and "screenshot" in text
    assert "PIL.Image.Image" in answers[0][0] and "builtins.bytes" in answers[1][0]
    assert answers[3] == ("error: the environment's step must return (text, is_error), not builtins.str", True)
    assert answers[4] == ("a screen of text", False)
    assert answers[6][1] and "images from tools" not in answers[6][0], answers[6]
    local = LocalEnvironment(Screens())
    assert asyncio.run(local(call, Episode("p", 4))) == ("a screen of text", False)
    assert asyncio.run(local(call, Episode("p", 0)))[1] is True
