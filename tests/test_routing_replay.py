"""Routing replay (R3) at the learner, on tiny random Qwen3-MoE models in float32: the engine samples
and records each token's experts, the learner's transformers forward replays them
(`asyncrl.learning.routing`), and the step records measure how often its router would choose
otherwise. Real models and the real engine, policy step and config; no mocks.

Models are drawn at a trained model's scale (`test_engine_moe.at_trained_scale`: decisive routers,
so a route is a clear choice and not a tie)."""

import copy

import msgspec
import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from asyncrl.bench.moe import rows_of as moe_rows_of
from asyncrl.config import (ConfigError, KLPenalty, Optimizer, PolicyCompute, PolicyConfig, PolicyLoss, SamplingConfig,
                            compose)
from asyncrl.engines import llama_decoder, moe
from asyncrl.engines.base import SamplingParams, SequenceInput, WindowOutput
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.learning.policy import Objective, policy_step
from asyncrl.learning.routing import RouteStats, replay_on, replayed_routes, route_metrics, route_shape
from asyncrl.learning.scoring import PolicyForward, token_logprobs
from asyncrl.learning.tensors import adamw, collate
from asyncrl.messages.structs import Segment, TrainingRow, int32_array
from engine_checks import NO_EOS, PROMPTS, seq
from test_engine_moe import MODELS, QWEN_MOE, RENORMALISES, at_trained_scale, moe_model, prefill

PARAMS = SamplingParams(temperature=1.0)


def rows_of(prompts: list[list[int]], outs) -> list[TrainingRow]:
    return moe_rows_of(prompts, outs, advantage=0.5)


def learner_logprobs(model, collated, replay: bool, routes=None, stats=None) -> torch.Tensor:
    routes = collated.routes if routes is None else routes
    with torch.no_grad(), replayed_routes(model, routes, replay, stats, collated.attention_mask > 0):
        logp, _ = token_logprobs(PolicyForward(model), collated.input_ids, collated.attention_mask, collated.targets,
                                 PARAMS.temperature, positions=collated.response_mask > 0)
    return logp


def max_gap(logp: torch.Tensor, collated) -> float:
    return float(((logp - collated.old_logprobs).abs() * collated.response_mask).max())


class ExpertCalls:
    """The ids and weights each sparse block's experts ran with, per layer, while open."""

    def __init__(self, model):
        self.blocks = [layer.mlp for layer in model.model.layers if moe.is_sparse(layer)]
        self.ids, self.weights, self.logits = [], [], []

    def __enter__(self):
        self.handles = [h for block in self.blocks for h in (
            block.experts.register_forward_hook(self._experts), block.gate.register_forward_hook(self._gate))]
        return self

    def _experts(self, module, args, output) -> None:
        self.ids.append(args[1])
        self.weights.append(args[2])

    def _gate(self, module, args, output) -> None:
        self.logits.append(output[0])

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def generate(model, prompts: list[list[int]], tokens: int):
    """Two windows per sequence (the second from the first's kept KV cache), joined: each token
    with its log-prob and its route, as the generator's merged sample carries them."""
    engine = TorchEngine(model, NO_EOS)

    def inputs(done):
        return [SequenceInput(prompt_ids=int32_array(p), response_ids=int32_array(d), seed=7 + i,
                              max_response_tokens=64, key=f"s{i}") for i, (p, d) in enumerate(zip(prompts, done))]

    first = engine.generate_window_sync(inputs([[]] * len(prompts)), tokens // 2, PARAMS)
    second = engine.generate_window_sync(inputs([o.token_ids.tolist() for o in first]), tokens - tokens // 2, PARAMS)
    return [WindowOutput(token_ids=np.concatenate([a.token_ids, b.token_ids]),
                         logprobs=np.concatenate([a.logprobs, b.logprobs]), finish_reason=b.finish_reason,
                         routes=np.concatenate([a.routes, b.routes])) for a, b in zip(first, second)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replayed_routes_give_the_engines_logprobs_and_forcing_others_changes_them(name):
    """(a) fp32, each family: the learner's log-probs with the rollout's routes replayed are the
    engine's behaviour log-probs (1e-5); routes other than the router's change them, and are then
    exactly what the engine's own decoder computes with those routes forced, gating weights
    recomputed from the router's logits at the forced ids (renormalised where the family does),
    with a gradient into every router."""
    model = moe_model(name)
    sparse = [layer for layer in model.model.layers if moe.is_sparse(layer)]
    prompts = [PROMPTS[i] for i in (0, 2, 4)]
    outs = generate(model, prompts, 8)
    assert all(o.routes.dtype == np.uint8 and o.routes.shape == (8, len(sparse), 2) for o in outs)
    collated = collate(rows_of(prompts, outs))
    assert max_gap(learner_logprobs(model, collated, replay=True), collated) < 1e-5

    moved = collated.routes.clone()  # the second expert of every replayed route moved
    known = moved[..., 0] >= 0
    moved[..., 1] = torch.where(known, (moved[..., 0] + 4) % 8, moved[..., 1])
    with ExpertCalls(model) as calls:
        forced = learner_logprobs(model, collated, replay=True, routes=moved)
    assert max_gap(forced, collated) > 1e-2
    for layer, (ids, weights, logits) in enumerate(zip(calls.ids, calls.weights, calls.logits)):
        at = known[..., layer].reshape(-1)
        assert torch.equal(ids[at], moved[..., layer, :].reshape(-1, 2)[at].long())
        probs = logits.float().softmax(-1).gather(-1, ids)
        expected = probs / probs.sum(-1, keepdim=True) if RENORMALISES[name] else probs
        torch.testing.assert_close(weights, expected, atol=1e-7, rtol=0)
    # The engine's decoder with the same routes forced (prompt positions: the router's own).
    decoder = llama_decoder.LlamaDecoder(model)
    for row, (prompt, out) in enumerate(zip(prompts, outs)):
        ids = torch.tensor([list(prompt) + out.token_ids.tolist()])
        recorded = moe.Routes()
        prefill(decoder, ids, recorded)
        routes = recorded.chosen.clone()
        start = len(prompt) - 1
        routes[0, start:start + len(out.token_ids)] = moved[row, start:start + len(out.token_ids)].to(torch.int16)
        for t in range(len(out.token_ids)):
            logits = prefill(decoder, ids[:, :start + t + 1], moe.Routes(forced=routes[:, :start + t + 1]))
            expected = torch.log_softmax(logits[0] / PARAMS.temperature, -1)[out.token_ids[t]]
            assert abs(float(forced[row, start + t]) - float(expected)) < 1e-5, (row, t)

    gates = [layer.mlp.gate.weight for layer in sparse]
    model.zero_grad()
    with replayed_routes(model, moved, replay=True):
        logp, _ = token_logprobs(PolicyForward(model), collated.input_ids, collated.attention_mask, collated.targets,
                                 1.0, positions=collated.response_mask > 0)
        (logp * collated.response_mask).sum().backward()
    assert all(g.grad is not None and float(g.grad.abs().sum()) > 0 for g in gates)


def top1_model(seed: int = 0):
    """A Qwen3-MoE whose tokens take one expert each, renormalised: the gate weight is 1 whatever
    the router's logits, so only the choice of expert moves a log-prob."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**dict(QWEN_MOE, num_experts_per_tok=1), norm_topk_prob=True)
    return at_trained_scale(Qwen3MoeForCausalLM(config))


def objective(replay: bool, kl: float = 0.0) -> Objective:
    policy = PolicyConfig(loss=PolicyLoss(dual_clip=None, agg="token-mean"), optimizer=Optimizer(lr=0.0, grad_clip=1e9),
                          compute=PolicyCompute(precision="fp32"))
    return Objective(policy, SamplingConfig(temperature=1.0), KLPenalty(coef=kl), router_replay=replay)


def perturbed(model, seed: int):
    """A copy of `model` whose routers are moved enough that some of their choices flip."""
    out = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for layer in out.model.layers:
            layer.mlp.gate.weight.add_(0.25 * torch.randn_like(layer.mlp.gate.weight))
    return out


def test_a_perturbed_router_flips_choices_and_replay_keeps_the_rollouts_experts():
    """(b) The learner's router perturbed so that some of its choices flip: `router_mismatch` > 0
    in the step record, replay on or off. Prompts of one token, so that every position whose route
    reaches a scored log-prob is a replayed one, and one expert per token (gate weight 1): with
    replay on the learner runs the rollout's experts at every replayed position and its log-probs
    are the engine's (1e-5; the step's `rollout_kl_k3` about 0, and a reference perturbed otherwise
    replays them too: `kl_ref` 0); with replay off they are not."""
    engine_model = top1_model()
    prompts = [[5], [11], [20], [27]]
    outs = generate(engine_model, prompts, 10)
    rows = rows_of(prompts, outs)
    collated = collate(rows)
    learner = perturbed(engine_model, seed=1)
    shape = route_shape(learner)
    stats = RouteStats(shape)
    with ExpertCalls(learner) as calls:
        replayed = learner_logprobs(learner, collated, replay=True, stats=stats)
    mismatch = route_metrics(stats.sums(), shape)["router_mismatch"]
    assert 0.05 < mismatch < 0.95, mismatch
    assert max_gap(replayed, collated) < 1e-5
    for layer, ids in enumerate(calls.ids):
        at = (collated.routes[..., layer, 0] >= 0).reshape(-1)
        assert torch.equal(ids[at], collated.routes[..., layer, :].reshape(-1, 1)[at].long())
    assert max_gap(learner_logprobs(learner, collated, replay=False), collated) > 1e-3

    # The real policy step, with a KL term to a reference whose routers are perturbed otherwise: its
    # record measures the router replay on or off, and with replay both forwards are the engine's.
    reference = perturbed(engine_model, seed=2)
    for replay in (True, False):
        metrics = policy_step(PolicyForward(copy.deepcopy(learner)), adamw(learner.parameters(), 0.0, 0.0), rows,
                              objective(replay, kl=0.1), reference_model=reference)
        assert (metrics["kl_ref"] < 1e-8) == replay, (replay, metrics["kl_ref"])
        assert metrics["router_mismatch"] == pytest.approx(mismatch, abs=0.1), (replay, metrics["router_mismatch"])
        assert metrics["router_replayable"] == sum(len(o.token_ids) for o in outs) * shape.layers
        assert metrics["expert_load_mean"] > 0 and metrics["expert_load_max"] >= metrics["expert_load_mean"]
        assert metrics["router_rows_refused"] == 0
        assert (metrics["rollout_kl_k3"] < 1e-8) == replay, (replay, metrics["rollout_kl_k3"])


def test_the_critic_and_the_reference_take_the_rollouts_routes_too():
    """The value learner's forwards (values for (E)GAE, its training step, the reference's log-probs
    of KL-in-reward) get each row's routes (`routed_row`) and replay them as the policy learner
    does: on the top-1 model with a perturbed router, a critic on the perturbed trunk values the
    positions as a critic on the rollout's trunk does, the reference scores the behaviour log-probs,
    and the critic's step trains its routers through the replayed gates."""
    from asyncrl.config import Compute, CriticConfig
    from asyncrl.learning.scoring import response_logprobs
    from asyncrl.learning.value import predict_values, value_step
    from asyncrl.messages.structs import ScoredTrajectory, routed_row
    from asyncrl.models.loading import value_model_from_policy

    engine_model = top1_model(seed=2)
    prompts = [[6], [13], [22]]
    rows = rows_of(prompts, generate(engine_model, prompts, 8))
    routed = [routed_row(r.segment) for r in rows]
    assert all(len(row) == 3 for row in routed)
    learner = perturbed(engine_model, seed=1)
    for replay, close in ((True, True), (False, False)):
        reference = response_logprobs(learner, routed, 1.0, replay=replay)
        gaps = [np.abs(ref - r.segment.new_logprobs).max() for ref, r in zip(reference, rows)]
        assert (max(gaps) < 1e-5) == close, (replay, gaps)

    critics = [value_model_from_policy(copy.deepcopy(m)) for m in (engine_model, learner)]
    with torch.no_grad():
        torch.manual_seed(3)
        critics[0].head.weight.normal_()
        critics[1].head.weight.copy_(critics[0].head.weight)
    expected = predict_values(critics[0], [row[:2] for row in routed])
    for replay, close in ((True, True), (False, False)):
        values = predict_values(critics[1], routed, replay=replay)
        assert (max(np.abs(v - e).max() for v, e in zip(values, expected)) < 1e-5) == close, replay

    critic = critics[1].train()
    trajectories = [ScoredTrajectory(segment=r.segment, score=1.0) for r in rows]
    value_step(critic, torch.optim.SGD(critic.parameters(), lr=0.0), trajectories,
               CriticConfig(compute=Compute(precision="fp32")), 1.0, replay=True)
    gates = [layer.mlp.gate.weight for layer in critic.backbone.layers]
    assert all(g.grad is not None and float(g.grad.abs().sum()) > 0 for g in gates)


def test_replay_holds_through_gradient_checkpointing():
    """With `policy.compute.gradient_checkpointing` a layer's forward runs again in the backward: the
    routers are replayed there too (the same gradients as without it) and measured once."""
    model = moe_model("qwen3_moe")
    prompts = [PROMPTS[i] for i in (0, 2, 4)]
    rows = rows_of(prompts, generate(model, prompts, 6))
    learner = perturbed(model, seed=1)
    grads, metrics = [], []
    for checkpointing in (False, True):
        lm = copy.deepcopy(learner)
        if checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        metrics.append(policy_step(PolicyForward(lm), torch.optim.SGD(lm.parameters(), lr=0.0), rows, objective(True)))
        grads.append({name: p.grad for name, p in lm.named_parameters() if p.grad is not None})
    assert metrics[0]["router_replayable"] == metrics[1]["router_replayable"] == 6 * 3 * 2
    assert metrics[0]["router_mismatch"] == metrics[1]["router_mismatch"] > 0
    assert grads[0].keys() == grads[1].keys() and float(grads[0]["model.layers.0.mlp.gate.weight"].abs().sum()) > 0
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5)


def test_routes_of_another_model_fail_their_row_with_a_reason(caplog):
    """Routes whose shape is not the model's (3 sparse layers for its 2) are never replayed: the
    row trains nothing, the step counts it and the log says why."""
    model = moe_model("qwen3_moe")
    outs = TorchEngine(model, NO_EOS).generate_window_sync([seq(0), seq(1)], 4, PARAMS)
    rows = rows_of([PROMPTS[0], PROMPTS[1]], outs)
    wrong = np.concatenate([rows[1].segment.new_routes, rows[1].segment.new_routes[:, :1]], axis=1)
    rows[1] = TrainingRow(segment=Segment(**{**{f: getattr(rows[1].segment, f) for f in Segment.__struct_fields__},
                                             "new_routes": wrong}), score=1.0, advantages=rows[1].advantages)
    with caplog.at_level("WARNING", logger="asyncrl.learning.policy"):
        metrics = policy_step(PolicyForward(model), adamw(model.parameters(), 0.0, 0.0), rows, objective(True))
    assert metrics["router_rows_refused"] == 1 and metrics["tokens_trained"] == 4
    assert "sample p1/0: routes of 3 sparse layers x top-2, but the model has 2 x top-2" in caplog.text


def test_replay_is_on_for_moe_models_and_refused_explicitly_on_dense_ones(tmp_path):
    """`model.router_replay`: auto replays on a mixture-of-experts model only; rollout on a dense
    one is refused in one line naming its family, from a directory's config.json before anything
    loads (and by the learner for a model it loads); verl's R3 is rollout; SGLang's routes are read (its own
    test: tests/test_sglang_real.py), vLLM's are not."""
    from transformers import Qwen3Config

    moe_dir, dense_dir = tmp_path / "moe", tmp_path / "dense"
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN_MOE)).save_pretrained(moe_dir)
    dense = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    dense.save_pretrained(dense_dir)
    base = ["model=tiny", "task=tiny", "model.source=hf"]
    assert compose([*base, f"model.path={moe_dir}"]).model.router_replay == "auto"
    assert compose([*base, f"model.path={moe_dir}", "actor_rollout_ref.actor.router_replay.mode=R3"]
                   ).model.router_replay == "rollout"
    with pytest.raises(ConfigError, match=rf"^model.router_replay=rollout replays a mixture-of-experts model's "
                                          rf"routes, but model.path={dense_dir} is a dense qwen3 model: set "
                                          rf"model.router_replay=auto or off$"):
        compose([*base, f"model.path={dense_dir}", "model.router_replay=rollout"])
    with pytest.raises(ConfigError, match="dense llama model"):
        compose(["model=tiny", "model.router_replay=rollout"])
    with pytest.raises(ConfigError, match="R2 has no counterpart here"):
        compose([*base, f"model.path={moe_dir}", "actor_rollout_ref.actor.router_replay.mode=R2"])
    assert compose([*base, f"model.path={moe_dir}", "model.router_replay=rollout", "engine=sglang"]
                   ).model.router_replay == "rollout"
    with pytest.raises(ConfigError, match="vLLM's are not read"):
        compose([*base, f"model.path={moe_dir}", "model.router_replay=rollout", "engine=vllm"])
    moe_model_ = moe_model("qwen3_moe")
    assert replay_on("auto", moe_model_) and replay_on("rollout", moe_model_) and not replay_on("off", moe_model_)
    from transformers import Qwen3ForCausalLM

    assert not replay_on("auto", Qwen3ForCausalLM(dense))
    with pytest.raises(ConfigError, match="the model is a dense qwen3 model"):
        replay_on("rollout", Qwen3ForCausalLM(dense))


def save_moe_directory(directory) -> str:
    """A tiny random Qwen3-MoE over the tiny task's character vocabulary, as a Hugging Face directory."""
    from asyncrl.models.loading import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=16, norm_topk_prob=True, max_position_embeddings=64, pad_token_id=0,
                            bos_token_id=2, eos_token_id=1, tie_word_embeddings=False)
    at_trained_scale(Qwen3MoeForCausalLM(config)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def test_a_moe_directory_trains_with_its_routes_replayed(ray_session, tmp_path):
    """(d) The real run (Ray actors, mailboxes, weight broadcast) on a tiny Qwen3-MoE directory,
    three windows per response: every step record measures the router against the rollout's routes
    (replay on: `auto` on a mixture-of-experts model), and the store keeps every token's route."""
    import json

    from asyncrl.driver import train
    from asyncrl.storage.trajectory_store import read_trajectories

    directory = save_moe_directory(tmp_path / "tiny-moe")
    config = compose(["model=tiny", "task=tiny", "algorithm=grpo", "model.source=hf", f"model.path={directory}",
                      "engine.window_tokens=1", "engine.max_response_tokens=3", "algorithm.group_size=8",
                      "trainer.total_steps=3", "trainer.store_trajectories=true", f"trainer.run_dir={tmp_path}/run",
                      "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0"])
    assert config.model.router_replay == "auto"
    summary = train(config, progress=False, eval_prompts=2)
    assert summary["steps"] == 3 and summary["final_status"]["ledger"]["problems"] == []
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(records) == 3
    for record in records:
        assert 0.0 <= record["router_mismatch"] <= 1.0 and record["router_rows_refused"] == 0
        # Every generated token of every trained row, at both sparse layers, was compared.
        assert record["router_replayable"] == 2 * record["tokens_trained"]
        assert record["expert_load_max"] >= record["expert_load_mean"] > 0
    # fp32 engine and learner, the rollout's routes replayed: the first step's weights are the
    # engine's, so its log-probs are the behaviour ones.
    assert records[0]["rollout_kl_k3"] < 1e-6 and records[0]["router_mismatch"] == 0.0
    stored = read_trajectories(str(tmp_path / "run"))
    assert stored and all(r.route_top_k == 2 and len(r.token_routes) == len(r.response_token_ids)
                          and all(len(t) == 4 and min(t) >= 0 for t in r.token_routes) for r in stored)


def test_the_policy_endpoint_answers_from_a_moe_directory_with_transformers_logprobs(tmp_path):
    """The `policy` application on a Qwen3-MoE directory: the embedded engine's MoE decoder answers
    (the class Serve wraps, its route's method), every sampled token's log-prob is transformers' own
    model's for it, and `n` samples of one prompt are whole, each its own."""
    import asyncio
    import json

    from transformers import AutoTokenizer

    from asyncrl.api.requests import CompletionRequest
    from asyncrl.serve.policy import PolicyServer

    directory = save_moe_directory(tmp_path / "tiny-moe")
    config = compose(["model=tiny", "task=tiny", "model.source=hf", f"model.path={directory}", "engine.dtype=float32",
                      "model.use_chat_template=false", "serve.follow_learner=false"])
    server = PolicyServer.func_or_class.__bases__[0](config)
    body = CompletionRequest(prompt="12+34=", max_tokens=6, n=3, seed=5, temperature=1.0, logprobs=1)
    reply = json.loads(asyncio.run(server.completions(body)).body)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    reference = Qwen3MoeForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = tokenizer.encode("12+34=", add_special_tokens=False)
    assert len(reply["choices"]) == 3 and reply["usage"]["prompt_tokens"] == len(prompt)
    samples = set()
    for choice in reply["choices"]:
        tokens, logprobs = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
        assert 1 <= len(tokens) <= 6 and len(logprobs) == len(tokens)
        ids = tokenizer.convert_tokens_to_ids(tokens)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        np.testing.assert_allclose(logprobs, expected.numpy(), atol=1e-4)
        samples.add(tuple(ids))
    assert len(samples) > 1  # n samples, not one answer copied


def test_a_sample_whose_routes_are_refused_ends_dropped_not_trained(tmp_path):
    """The learner's step refuses a row whose routes are another model's; the ledger hears that
    sample as dropped (`routes_misfit`), the other as trained, and the counters agree."""
    import asyncio

    from actors.policy_learner import LearnerEdges, build_policy_learner
    from asyncrl.config import compose
    from asyncrl.messages.mailbox import InProcessMailbox
    from asyncrl.messages.structs import DropReason, TrainBatch

    directory = save_moe_directory(tmp_path / "tiny-moe")
    config = compose(["model=tiny", "task=tiny", "algorithm=grpo", "model.source=hf", f"model.path={directory}"])
    heard: dict[str, list] = {"trained": [], "dropped": []}

    async def trained(ids):
        heard["trained"] += ids

    async def dropped(ids, reason):
        heard["dropped"] += [(i, reason) for i in ids]

    learner = build_policy_learner(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0,
                                   InProcessMailbox(2), LearnerEdges(trained=trained, dropped=dropped))
    outs = TorchEngine(learner.model, NO_EOS).generate_window_sync([seq(0), seq(1)], 3, PARAMS)
    rows = rows_of([PROMPTS[0], PROMPTS[1]], outs)
    wrong = np.concatenate([rows[1].segment.new_routes, rows[1].segment.new_routes[:, :1]], axis=1)
    rows[1] = TrainingRow(segment=Segment(**{**{f: getattr(rows[1].segment, f) for f in Segment.__struct_fields__},
                                             "new_routes": wrong}), score=1.0, advantages=rows[1].advantages)
    record = asyncio.run(learner.train_on(TrainBatch(batch_id="b0", rows=rows)))
    assert record["router_rows_refused"] == 1
    assert heard == {"trained": ["p0/0"], "dropped": [("p1/0", DropReason.ROUTES_MISFIT)]}
    assert learner.counters["samples_trained"] == 1


def test_the_router_balance_loss_trains_the_gates_when_asked_and_is_refused_on_dense_models(tmp_path):
    """`policy.loss.router_aux_coef`: the step records the balance loss (as the algorithm's function
    computes it over the real positions) and its gradient reaches the routers (and what feeds them),
    the same with gradient checkpointing (each layer's logits taken once); 0 adds nothing; a dense model refuses it in one line."""
    from asyncrl.algo.losses import router_balance_loss

    model = moe_model("qwen3_moe")
    prompts = [PROMPTS[i] for i in (0, 2, 4)]
    rows = rows_of(prompts, generate(model, prompts, 6))
    grads, records = {}, {}
    for coef, checkpointing in ((0.0, False), (1.0, False), (1.0, True)):
        lm = copy.deepcopy(model)
        if checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base = objective(True)
        aux = Objective(PolicyConfig(**{**msgspec.structs.asdict(base.policy),
                                        "loss": PolicyLoss(dual_clip=None, agg="token-mean", router_aux_coef=coef)}),
                        base.sampling, base.kl, router_replay=True)
        records[coef, checkpointing] = policy_step(PolicyForward(lm), torch.optim.SGD(lm.parameters(), lr=0.0), rows, aux)
        grads[coef, checkpointing] = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    assert "router_balance_loss" not in records[0.0, False]
    # The same value from the routers' logits over the rows' real positions.
    collated = collate(rows, 0)
    logits = []
    with torch.no_grad(), replayed_routes(model, None, False, router_logits=logits):
        model(input_ids=collated.input_ids, attention_mask=collated.attention_mask)
    expected = router_balance_loss(logits, 2, collated.attention_mask.reshape(-1) > 0).item()
    assert records[1.0, False]["router_balance_loss"] == pytest.approx(expected, rel=1e-5) and expected > 2.0
    moved = {n for n in grads[0.0, False] if not torch.allclose(grads[0.0, False][n], grads[1.0, False][n], atol=1e-7)}
    # It reaches every router and what feeds one, never what only reads the last layer's experts.
    last = len(model.model.layers) - 1
    assert {f"model.layers.{i}.mlp.gate.weight" for i in range(last + 1)} <= moved, moved
    assert not moved & {"lm_head.weight", "model.norm.weight", f"model.layers.{last}.mlp.experts.down_proj"}, moved
    for name, grad in grads[1.0, False].items():
        torch.testing.assert_close(grads[1.0, True][name], grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(ConfigError, match=r"^policy.loss.router_aux_coef=0.01 balances a mixture-of-experts model's "
                                          r"experts, but model.source=tiny is a dense llama model: set it to 0$"):
        compose(["model=tiny", "policy.loss.router_aux_coef=0.01"])


@pytest.mark.slow
def test_a_random_moe_learns_the_tiny_task_to_0_9_with_replay(ray_session, tmp_path):
    """The issue's measure, end to end through the real actors: a tiny random Qwen3-MoE (8 experts,
    top-2, `asyncrl.bench.moe`) on the tiny task, replay on (auto), reaches 0.9 held-out."""
    from asyncrl.bench.moe import write_tiny_moe
    from asyncrl.driver import train

    directory = write_tiny_moe(str(tmp_path / "tiny-moe"))
    config = compose(["model=tiny", "task=tiny", "algorithm=grpo", "model.source=hf", f"model.path={directory}",
                      "trainer.total_steps=400", "trainer.target_reward=0.9", f"trainer.run_dir={tmp_path}/run",
                      "trainer.wandb_mode=disabled"])
    assert config.model.router_replay == "auto"
    summary = train(config, progress=False)
    records = summary["records"]
    assert summary["eval_after"]["accuracy"] >= 0.9, (summary["eval_before"], summary["eval_after"], len(records))
    assert all("router_mismatch" in r for r in records if not r.get("skipped"))


@pytest.mark.slow  # the demo's run through the command line, on a random MoE: ~2 minutes
def test_the_demos_run_on_a_small_random_moe_trains_evaluates_and_exports(tmp_path):
    """`asyncrl train` as `make demo` runs it (DAPO on the arithmetic word problems, two windows a
    response, the embedded model's tokenizer and chat template), with a small random Qwen3-MoE
    directory in place of SmolLM2: it trains with the rollout's routes replayed, each step record
    carries the router's mismatch and the experts' load, `asyncrl eval` scores its checkpoint and
    `asyncrl export` writes a Qwen3-MoE that transformers loads. A random model earns no reward on
    arithmetic, so DAPO's dynamic sampling would skip every step (each record says so): the filter
    is off here, so that the learner's steps run."""
    import json

    from transformers import AutoModelForCausalLM

    from asyncrl.bench.moe import EXPERTS, LAYERS, tiny_moe
    from asyncrl.models.loading import load_tokenizer
    from test_first_hour import asyncrl

    tokenizer = load_tokenizer(compose([]).model)  # the embedded SmolLM2's, its chat template included
    directory, run = tmp_path / "small-moe", tmp_path / "run"
    model = tiny_moe(0, vocab=len(tokenizer))
    model.config.update({"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                         "eos_token_id": tokenizer.eos_token_id})
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)

    code, out, _ = asyncrl("train", "model.source=hf", f"model.path={directory}", "trainer.total_steps=3",
                           "algorithm.dynamic_sampling.enabled=false", f"trainer.run_dir={run}", cwd=tmp_path)
    assert code == 0, out[-3000:]
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert len(records) == 3 and json.load(open(run / "config.json"))["algorithm"]["name"] == "dapo"
    for record in records:
        assert record["router_replayable"] == LAYERS * record["tokens_trained"] > 0
        assert 0.0 <= record["router_mismatch"] <= 1.0 and record["router_rows_refused"] == 0
        assert record["expert_load_max"] >= record["expert_load_mean"] > 0

    code, out, _ = asyncrl("eval", "--checkpoint", str(run), "--prompts", "8", "--out", str(tmp_path / "eval"),
                           cwd=tmp_path)
    assert code == 0, out[-3000:]
    result = json.load(open(tmp_path / "eval" / "eval.json"))
    assert result["prompts"] == 8 and 0.0 <= result["pass@1"] <= 1.0
    code, out, _ = asyncrl("export", str(run), str(tmp_path / "export"), cwd=tmp_path)
    assert code == 0, out[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(exported).__name__ == "Qwen3MoeForCausalLM" and exported.config.num_experts == EXPERTS
