"""The cross-field rules of a composed config: what no single field's type or range can say. Every
rule is one line of a message naming the fields; a bad setting is refused at start-up, never
silently ignored. (Ranges and allowed names live on the fields: `asyncrl.config.fields`.)"""

from __future__ import annotations

import importlib.util
import json
import os

from asyncrl.config.algorithm import GAEAdvantage, PairwiseAdvantage
from asyncrl.config.reward import GenerativeJudgeEndpoint, ProcessRewardEndpoint, RouteConfig, VerifierEndpoint


# vLLM's CPU attention kernels take these head sizes only (vLLM 0.32's
# `CPUAttentionBackend.get_supported_head_sizes`; tests/test_vllm_real.py holds the two equal). A
# model with another fails at its first forward, not at load: `_vllm_checks` refuses it.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field."""


def validate(config) -> None:
    """Every cross-field rule; the first broken one is raised."""
    for ok, message in [*_vision_checks(config), *_algorithm_checks(config), *_placement_checks(config),
                        *_mode_checks(config), *_reward_checks(config), *_vllm_checks(config)]:
        if not ok:
            raise ConfigError(message)


def _algorithm_checks(config) -> list[tuple[bool, str]]:
    e, a, critic = config.engine, config.algorithm, config.critic
    gae = a.advantage if isinstance(a.advantage, GAEAdvantage) else None
    return [
        (e.long_tail_tokens <= e.max_response_tokens, "engine.long_tail_tokens must be <= engine.max_response_tokens"),
        (a.overlong.buffer_tokens < e.max_response_tokens,
         "algorithm.overlong.buffer_tokens must be < engine.max_response_tokens"),
        (config.model.source != "hf" or bool(config.model.path),
         "model.source=hf needs model.path: the Hugging Face directory to load"),
        (config.task.name == "file" or not (config.task.path or config.task.eval_path),
         f"task.path and task.eval_path are read by task=file only; task={config.task.name} has prompts of its "
         f"own: add task=file to train on the files"),
        (not (config.environment.name and config.environment.class_path),
         "environment.name and environment.class_path name two environments: set one"),
        (gae is None or not gae.kl_in_reward or a.kl.coef > 0,
         "algorithm.advantage.kl_in_reward needs algorithm.kl.coef > 0"),
        (gae is None or not gae.window_training or not any(route.dense for route in config.reward.routes),
         "process rewards (reward.routes[*].dense) cannot train T-PPO's windows: a process reward model "
         "scores a finished response, after its earlier windows were trained; use algorithm=vapo or ppo "
         "(whole responses), or drop the dense endpoints"),
        (gae is None or not (gae.window_training and a.dynamic_sampling.enabled),
         "algorithm.dynamic_sampling cannot filter T-PPO's windows: they train as they stream, before "
         "their group is complete; set algorithm.dynamic_sampling.enabled=false, or "
         "algorithm.advantage.window_training=false to train whole responses (then groups are filtered)"),
        (gae is None or not gae.window_training or gae.edge_mask_tokens < e.window_tokens
         or e.window_tokens >= e.max_response_tokens,
         f"algorithm.advantage.edge_mask_tokens={gae.edge_mask_tokens if gae else 0} leaves every token of a cut "
         f"window out of the loss (engine.window_tokens={e.window_tokens}): only the last window of each response "
         f"would train; set it below the window (T-PPO's recipe masks 8 of 8,192 tokens)"),
        (gae is None or a.dynamic_sampling.max_refill_rounds == 0,
         "algorithm.dynamic_sampling.max_refill_rounds bounds how long a group estimator's batch waits for "
         "groups with a signal; advantage type gae cuts batches by finished samples: set it to 0"),
        (gae is not None or not critic.init_path,
         "critic.init_path initialises the value learner, which only algorithm.advantage.type=gae has"),
        (critic.optimizer.schedule == "constant" or critic.optimizer.decay_steps > 0,
         f"critic.optimizer.schedule={critic.optimizer.schedule} needs critic.optimizer.decay_steps: the value "
         "learner's steps follow its own pace, not trainer.total_steps"),
        *[(o.schedule == "constant" or not o.decay_steps or o.decay_steps > o.warmup_steps,
           f"{name}.optimizer.decay_steps={o.decay_steps} must be past its warmup_steps={o.warmup_steps}: the "
           f"rate would fall from lr to its floor at once") for name, o in (("policy", config.policy.optimizer),
                                                                          ("critic", critic.optimizer))],
        (critic.warmup.steps == 0 or critic.warmup.min_steps <= critic.warmup.steps,
         "critic.warmup.min_steps must be <= critic.warmup.steps"),
        (not config.trainer.synchronous or a.max_staleness_versions == 0,
         "trainer.synchronous needs algorithm.max_staleness_versions=0"),
        (config.task.pre_ppo_fraction == 0 or config.task.pre_ppo_endpoint in config.reward.endpoints,
         "task.pre_ppo_endpoint must name an entry of reward.endpoints"),
        *_lora_checks(config),
        *_router_checks(config),
    ]


def model_family(model) -> tuple[str | None, bool]:
    """(model_type, whether it is a mixture of experts) of the `model` section, as far as is known
    without loading it: the tiny and the embedded models are Llamas, a directory says in its
    `config.json`; (None, False) where it cannot be read (the learner checks the model itself)."""
    if model.source == "tiny" or (model.source == "gguf" and not model.path):
        return "llama", False
    try:
        with open(os.path.join(model.path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None, False
    if not isinstance(config, dict):
        return None, False
    experts = ("num_experts", "num_local_experts", "n_routed_experts")
    return config.get("model_type"), any(isinstance(config.get(k), int) and config[k] > 0 for k in experts)


def _router_checks(config) -> list[tuple[bool, str]]:
    """Routing replay asked for explicitly (`model.router_replay=rollout`; auto does what the model
    allows), and the router balance loss (`policy.loss.router_aux_coef`), on a mixture-of-experts model."""
    m, aux = config.model, config.policy.loss.router_aux_coef
    if m.router_replay != "rollout" and not aux:
        return []
    family, sparse = model_family(m)
    where = f"model.path={m.path}" if m.path else f"model.source={m.source}"
    if m.router_replay != "rollout":
        return [(family is None or sparse, f"policy.loss.router_aux_coef={aux:g} balances a mixture-of-experts "
                                           f"model's experts, but {where} is a dense {family} model: set it to 0")]
    return [
        (family is None or sparse, f"model.router_replay=rollout replays a mixture-of-experts model's routes, but "
                                   f"{where} is a dense {family} model: set model.router_replay=auto or off"),
        (config.engine.name != "vllm", "model.router_replay=rollout replays the routes the engine records: the "
                                        "embedded engine's (engine=torch) or SGLang's (engine=sglang, "
                                        "--enable-return-routed-experts); vLLM's are not read: set "
                                        "model.router_replay=off, or engine=torch or sglang"),
    ]


def is_vision_model_section(model) -> bool:
    """Whether the `model` section names a vision-language model (tiny_vl, or a directory whose
    config.json has a vision tower's), without loading it."""
    if model.source == "tiny_vl":
        return True
    try:
        with open(os.path.join(model.path, "config.json")) as f:
            return "vision_config" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def _vision_checks(config) -> list[tuple[bool, str]]:
    """Images (task=shapes, or a vision-language model): what runs them today."""
    m, vision = config.model, is_vision_model_section(config.model)
    where = f"model.path={m.path}" if m.path else f"model.source={m.source}"
    if not vision:
        return [(config.task.name != "shapes", f"task=shapes gives every prompt an image, and {where} is a "
                                               f"text-only model: use model=tiny_vl or a vision-language directory")]
    return [
        (config.engine.name == "torch", f"{where} is a vision-language model: prompts with images run on the "
                                        f"embedded engine (engine=torch); engine={config.engine.name} is not given "
                                        f"the images yet"),
        # LoRA adapts the language model alone (`asyncrl.weights.lora.language_model`); peft freezes every other
        # weight, and a LoRA update carries the adapter alone: a tower trained whole would reach no generator.
        (not (m.lora_rank and not m.freeze_vision_tower),
         f"{where} is a vision-language model: model.lora_rank > 0 adapts its language model and keeps the vision "
         f"tower frozen; model.freeze_vision_tower=false (the tower trained whole) needs model.lora_rank=0"),
        # mode=learn replays a trajectory store's records with their images (the store keeps a copy of
        # each) through the online learners; DQO's own step and a labelled file's responses take none.
        (config.mode != "learn" or config.algorithm.name != "dqo",
         f"{where} is a vision-language model: algorithm=dqo's offline step does not take images yet (replay "
         f"the store with the algorithm it was recorded with, or learn online)"),
        (config.mode != "learn" or not config.offline.data or os.path.isdir(config.offline.data),
         f"{where} is a vision-language model: offline.data={config.offline.data} is a file of labelled "
         f"responses, whose images are not read yet; mode=learn replays a trajectory store with its images"),
    ]


def _lora_checks(config) -> list[tuple[bool, str]]:
    """LoRA and delta updates (`asyncrl.weights.lora`, `asyncrl.weights.delta`). Whether the model has the
    target modules is checked against the model itself at start-up (`asyncrl.weights.lora.check_targets`)."""
    m, p = config.model, config.policy
    targets = m.target_modules
    return [
        (isinstance(targets, list) or targets == "all-linear",
         f"model.target_modules={targets}: all-linear, or a list of module names (e.g. [q_proj, v_proj])"),
        (not isinstance(targets, list) or bool(targets), "model.target_modules must name at least one module"),
        (not (m.lora_rank and p.weight_delta),
         "policy.weight_delta sends the changed weights of a full fine-tune; with model.lora_rank > 0 every "
         "update is the adapter alone already: set one of them"),
        (not p.weight_delta or config.engine.name != "torch" or config.engine.dtype != "auto",
         "policy.weight_delta computes what changed in the embedded engine's dtype, which the learner must "
         "know: set engine.dtype=bfloat16 or float32 (auto is measured by each generator at start-up)"),
    ]


def _placement_checks(config) -> list[tuple[bool, str]]:
    e, p, c = config.engine, config.policy.compute, config.critic.compute
    cluster = config.cluster
    return [
        (cluster.min_generators <= cluster.max_generators, "cluster.min_generators must be <= cluster.max_generators"),
        (not cluster.autoscale or cluster.min_generators <= cluster.num_generators <= cluster.max_generators,
         "cluster.num_generators must lie in [min_generators, max_generators] when cluster.autoscale is on"),
        (e.device != "cuda" or e.gpus > 0, "a generator on CUDA (engine.device=cuda) needs engine.gpus > 0"),
        (p.device != "cuda" or p.gpus > 0, "policy.compute.device=cuda needs policy.compute.gpus > 0"),
        (c.device != "cuda" or c.gpus > 0, "critic.compute.device=cuda needs critic.compute.gpus > 0"),
        (e.name != "sglang" or e.device == "cuda" or e.gpus == 0,
         f"engine.device=cpu with engine.gpus={e.gpus}: SGLang on CPU takes no GPU (engine.gpus=0, "
         "as engine=sglang sets on CPU)"),
        (e.name != "sglang" or e.device == "cuda" or e.sglang_max_total_tokens > 0,
         "engine=sglang on CPU needs engine.sglang_max_total_tokens > 0: its KV cache is ordinary RAM "
         "(engine=sglang sets 8192 on CPU)"),
        (e.name != "sglang" or not e.sglang_max_total_tokens or e.sglang_max_total_tokens > e.max_response_tokens,
         f"engine.sglang_max_total_tokens={e.sglang_max_total_tokens} cannot hold one response of "
         f"engine.max_response_tokens={e.max_response_tokens} and its prompt"),
    ]


def _vllm_checks(config) -> list[tuple[bool, str]]:
    """`engine=vllm`: vLLM's CPU build (`make vllm`), and what asyncrl does not run on it yet."""
    e, m = config.engine, config.model
    if e.name != "vllm":
        return []
    head = head_size(m)
    return [
        (importlib.util.find_spec("vllm") is not None,
         "engine=vllm needs vLLM, which this environment lacks: `make vllm` builds .venv-vllm (vLLM's CPU "
         "build), then run .venv-vllm/bin/asyncrl"),
        (e.device == "cpu", "engine=vllm runs vLLM's CPU build (vllm-cpu): set engine.device=cpu, or engine=sglang "
                            "on a GPU"),
        (e.gpus == 0, f"engine=vllm on CPU takes no GPU: set engine.gpus=0 (engine.gpus={e.gpus})"),
        (e.vllm_kv_cache_mb > 0, "engine=vllm on CPU needs engine.vllm_kv_cache_mb > 0: its KV cache is ordinary "
                                 "RAM (engine=vllm sets 512)"),
        (head is None or head in VLLM_CPU_HEAD_SIZES,
         f"engine=vllm: vLLM's CPU attention has no kernel for this model's head size {head} (it takes "
         f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); model=tiny: set model.num_heads so that "
         f"model.hidden_size / model.num_heads is one of them (e.g. model.num_heads=2)"),
        (config.sampling.temperature <= 2 and (config.sampling.first_token_temperature or 0) <= 2,
         "engine=vllm: vLLM samples at temperatures up to 2; set sampling.temperature and "
         "sampling.first_token_temperature (FIRE) to at most 2, or use engine=torch or engine=sglang"),
    ]


def head_size(model) -> int | None:
    """The attention head size of the `model` section, as far as is known without loading it."""
    if model.source == "tiny":
        return model.hidden_size // model.num_heads
    if model.source == "gguf" and not model.path:
        return 64  # the embedded SmolLM2-135M: 576 / 9
    try:
        with open(os.path.join(model.path, "config.json")) as f:
            config = json.load(f)
        return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def _mode_checks(config) -> list[tuple[bool, str]]:
    a, offline, trainer = config.algorithm, config.offline, config.trainer
    return [
        (config.mode != "generate" or trainer.store_trajectories,
         "mode=generate keeps nothing but the store: set trainer.store_trajectories=true"),
        (config.mode != "learn" or bool(offline.data), "mode=learn needs offline.data (a store or a file)"),
        (a.name != "dqo" or config.mode == "learn", "algorithm=dqo learns offline: run it with mode=learn"),
        (offline.train != "value" or a.value_based,
         "offline.train=value pretrains a critic: use a value-based algorithm (ppo, vcppo, vapo, tppo)"),
        (config.policy.compute.ranks == 1 or config.mode == "train",
         "policy.compute.ranks > 1 shards the online learner; mode=learn and mode=generate run one rank"),
        (trainer.max_train_s == 0 or config.mode == "train",
         "trainer.max_train_s bounds an online run (mode=train); mode=learn and mode=generate stop by their steps"),
        (trainer.eval_every == 0 or config.task.name != "file" or bool(config.task.eval_path),
         f"trainer.eval_every={trainer.eval_every} scores held-out prompts as the run trains, but task=file has "
         f"no task.eval_path (the held-out files): set task.eval_path, or trainer.eval_every=0"),
        (trainer.max_generated_samples == 0 or config.mode == "train",
         "trainer.max_generated_samples bounds an online run (mode=train); mode=learn and mode=generate stop "
         "by their steps"),
    ]


def route_checks(routes: list[RouteConfig], endpoint_names: set[str]) -> list[tuple[bool, str]]:
    """Checks of reward routes (at start-up, and when the admin route changes them)."""
    checks = []
    for i, route in enumerate(routes):
        for name in [*route.endpoints, *route.dense]:
            checks.append((name in endpoint_names, f"reward.routes[{i}] names unknown endpoint {name!r}"))
        checks.append((bool(route.endpoints), f"reward.routes[{i}].endpoints must not be empty"))
        checks.append((route.combine != "mix" or len(route.weights) == len(route.endpoints),
                       f"reward.routes[{i}].weights must give one weight per endpoint for combine=mix"))
    return checks


def _reward_checks(config) -> list[tuple[bool, str]]:
    r, advantage = config.reward, config.algorithm.advantage
    checks = [(bool(r.endpoints), "reward.endpoints must name at least one endpoint")]
    for name, e in r.endpoints.items():
        # A process reward model scores every response token; an episode's observations are the
        # environment's, and its rewards would land on them.
        checks.append((not isinstance(e, ProcessRewardEndpoint) or not config.environment.enabled,
                       f"reward.endpoints.{name}: a process reward model (prm) cannot score episodes with an "
                       f"environment (environment.name={config.environment.name or config.environment.class_path}): "
                       f"its token rewards would fall "
                       f"on the observations"))
        # The endpoint's own bound on one call must end before the call's deadline: else a hung
        # function or server is only ever cut off by the deadline, with every sample not yet scored.
        own = {"python": "call_timeout_s", "openai": "request_timeout_s"}.get(e.kind)
        if own is not None:
            checks.append((getattr(e, own) < r.timeout_s,
                           f"reward.endpoints.{name}.{own}={getattr(e, own):g} must be below reward.timeout_s="
                           f"{r.timeout_s:g} (the deadline of a whole call): else a hung sample or request is only "
                           f"cut off by the deadline, which fails it with every sample of the call not yet scored"))
    checks += route_checks(r.routes, set(r.endpoints))
    if isinstance(advantage, PairwiseAdvantage):
        judge = r.endpoints.get(advantage.endpoint)
        found = (f"names a {judge.kind} endpoint" if judge is not None
                 else f"names no endpoint of reward.endpoints ({', '.join(r.endpoints)})")
        checks.append((isinstance(judge, (GenerativeJudgeEndpoint, VerifierEndpoint)),
                       f"algorithm.advantage.endpoint={advantage.endpoint!r} {found}: Pairwise PPO's judge must be an "
                       f"endpoint of kind genrm (a generative judge) or verifier (the rule verifier: the higher "
                       f"score wins)"))
    return checks
