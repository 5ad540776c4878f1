"""LoRA on the policy (`model.lora_rank > 0`): peft's adapters on the learner, the adapter alone
to the generators, and its merge into the base weights they hold.

* The learner trains `W0 + (alpha / r) * B @ A` per target module (peft's `LoraConfig`, dropout 0,
  B starting at 0 so version 0 is the base model); the base weights `W0` stay frozen, and the
  optimizer holds A and B only. The model keeps its transformers class (peft injects its layers
  into it), so the learner's forward, FSDP2's units and the embedded engine's decoder are unchanged.
* A version reaches a generator as its adapter: `<module>.lora_A` `[r, in]` and `<module>.lora_B`
  `[out, r]` per module, plus rank and alpha (`asyncrl.weights.sync.AdapterSpec`). The generator keeps
  the base weights of those modules unmerged (`AdapterMerger`) and loads `merge(W0, A, B, scale)`
  for each version: version n+1 is never merged on top of version n.
* A mixture-of-experts model's fused experts (3-D parameters) are adapted when named
  (`experts.gate_up_proj`, `experts.down_proj`: peft's `target_parameters`); their adapter travels
  as `<block>.experts.gate_up_proj.lora_A` / `.lora_B` and merges by `lora_experts.merge_experts`.
  Routers never are (routing replay).
* A vision-language model's (Qwen2-VL's) language model alone is adapted (`language_model`); the
  vision tower and its merger stay frozen at the base, as every generator already holds them, and a
  checkpoint or export carries the image processor as a full one's does.
* Checkpoints and `asyncrl export --adapter` hold the adapter in peft's own format
  (`adapter_config.json`, `adapter_model.safetensors`: `PeftModel.from_pretrained` loads it) and the
  base model's settings (`asyncrl_model.json`), from which `asyncrl export` builds the merged model.

Names: the learner's modules after injection are `<module>.base_layer.weight`,
`<module>.lora_A.default.weight` and `<module>.lora_B.default.weight`; the generators and a plain
Hugging Face model know `<module>.weight`.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

import msgspec
import torch

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.weights import lora_experts
from asyncrl.weights.lora_experts import is_sparse_block

ADAPTER = "default"  # peft's name of the one adapter
_A, _B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
BASE_LAYER = ".base_layer"
PEFT_PREFIX = "base_model.model."  # what peft's saved names start with
MODEL_FILE = "asyncrl_model.json"  # the base model's settings, beside the adapter
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


# --- which modules ---------------------------------------------------------------------------------


def adaptable_modules(model: torch.nn.Module) -> list[str]:
    """Full names of the modules `all-linear` adapts: every linear layer but the output head (peft's
    convention; a head tied to the input embedding would change it too) and a mixture-of-experts
    model's routers. On such a model that is attention (and Qwen2-MoE's shared expert and its gate),
    never the experts: transformers 5 holds them as 3-D parameters, not linear layers. The routers
    are left out explicitly (whatever their class): routing replay forces the rollout's experts,
    and an adapted router would move the choices it replays. On a vision-language model only the
    language model's layers are (`language_model`): never the vision tower nor its merger."""
    skip = {id(output_head(model))} | {id(module.gate) for module in model.modules() if is_sparse_block(module)}
    inside = {id(module) for module in language_model(model).modules()}
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and id(module) not in skip and id(module) in inside]


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The part of `model` LoRA adapts: a vision-language model's language model (transformers'
    `get_decoder`: Qwen2-VL's `model.language_model`), a text model whole. The vision tower stays
    as `model.freeze_vision_tower` says, and the generators hold its weights from the base already."""
    from asyncrl.models.vision import is_vision_model

    if not is_vision_model(model):
        return model
    decoder = model.get_decoder()
    if is_vision_model(decoder):  # transformers found no part without the tower (the model itself, or its trunk)
        raise ConfigError(f"{type(model).__name__}: its language model cannot be told apart from its vision "
                          f"tower (transformers' get_decoder), so LoRA cannot leave the tower out")
    return decoder


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def resolve_targets(model: torch.nn.Module, targets: str | list[str]) -> list[str]:
    """The full names of what `targets` selects: modules (`all-linear`, or names that a module's name
    is or ends with, as peft matches them), then a mixture-of-experts model's fused expert parameters
    named with their module (`experts.gate_up_proj`, `experts.down_proj`: `lora_experts.selects`).
    The output head is adapted only when named and not tied to the input embedding. A router named is
    refused (routing replay), and so is a name that selects nothing, naming what the model has."""
    modules = adaptable_modules(model)
    if targets == "all-linear":
        return modules
    _refuse_routers(model, targets)
    head = output_head(model)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if isinstance(head, torch.nn.Linear) and not tied:
        modules += [name for name, module in model.named_modules() if module is head]
    experts = lora_experts.expert_parameters(model)

    def picks(target: str, module: str) -> bool:
        return module == target or module.endswith("." + target)

    missing = [t for t in targets if not any(picks(t, m) for m in modules)
               and not any(lora_experts.selects(t, p) for p in experts)]
    if missing:
        have = sorted({m.rsplit(".", 1)[-1] for m in modules} | {".".join(p.split(".")[-2:]) for p in experts})
        tied = " (its output head is tied to the input embedding: not adaptable)" if tied else ""
        moe = ("; on a mixture-of-experts model LoRA adapts the experts when named with their module "
               "(experts.gate_up_proj, experts.down_proj), never the routers (routing replay)"
               ) if any(map(is_sparse_block, model.modules())) else ""
        vision = ("; on a vision-language model LoRA adapts the language model's, never the vision tower's or "
                  "its merger's") if language_model(model) is not model else ""
        raise ConfigError(f"model.target_modules: {type(model).__name__} has no linear module named "
                          f"{', '.join(missing)}; the modules LoRA can adapt are {', '.join(have)}{tied}{moe}{vision}")
    return ([m for m in modules if any(picks(t, m) for t in targets)]
            + [p for p in experts if any(lora_experts.selects(t, p) for t in targets)])


def _refuse_routers(model: torch.nn.Module, targets: list[str]) -> None:
    routers = lora_experts.routers(model)
    named = [t for t in targets if any(r == t or r.endswith("." + t) for r in routers)]
    if named:
        raise ConfigError(f"model.target_modules: {', '.join(named)} names the routers of {type(model).__name__}'s "
                          f"mixture-of-experts blocks (<block>.gate); LoRA never adapts a router: routing replay "
                          f"forces the rollout's experts, and an adapted router would move the choices it replays")


def check_targets(model_config: ModelConfig, engine: str = "torch") -> list[str]:
    """At start-up: the target modules of `model_config` against its architecture (built on the meta
    device: no weights are read). Raises `ConfigError` naming the modules it has, or when experts are
    adapted for a generator `engine` other than the embedded one."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from asyncrl.models.loading import build_tiny_model, build_tiny_tokenizer, embedded_gguf_dir, load_tokenizer
    from asyncrl.models.vision import build_tiny_vl_model

    with torch.device("meta"):
        if model_config.source == "tiny":
            skeleton = build_tiny_model(model_config, len(build_tiny_tokenizer()))
        elif model_config.source == "tiny_vl":
            skeleton = build_tiny_vl_model(model_config, load_tokenizer(model_config))
        else:
            if model_config.source == "gguf":
                config = AutoConfig.from_pretrained(model_config.path or embedded_gguf_dir(),
                                                    gguf_file=model_config.gguf_file)
            else:
                config = AutoConfig.from_pretrained(model_config.path, trust_remote_code=model_config.trust_remote_code)
            # A vision-language directory loads as its conditional-generation class (`load_model`).
            auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) else AutoModelForCausalLM
            skeleton = auto.from_config(config, trust_remote_code=model_config.trust_remote_code)
    targets = resolve_targets(skeleton, model_config.target_modules)
    if engine != "torch" and any(map(lora_experts.is_expert_parameter, targets)):
        # SGLang's checkpoint and loader hold the experts one by one (experts.<e>.gate_proj.weight), not fused.
        raise ConfigError(f"model.target_modules={model_config.target_modules}: LoRA on the experts needs the "
                          f"embedded engine (engine=torch), not engine={engine}")
    return targets


# --- the learner's side ----------------------------------------------------------------------------


def peft_config(model_config: ModelConfig, targets: list[str] | str, parameters: list[str] | None = None):
    from peft import LoraConfig

    # lora_dropout stays 0: peft refuses dropout on parameter targets (it cannot factor x out of B(A(drop(x)))).
    return LoraConfig(r=model_config.lora_rank, lora_alpha=model_config.lora_alpha, target_modules=targets,
                      target_parameters=parameters or None, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def wrap(lm, model_config: ModelConfig):
    """peft's LoRA on `lm`, in place: returns the `PeftModel` (saving, peft's own state dicts); `lm`
    itself is the model the learner trains (`PeftModel.get_base_model()`), its base weights frozen."""
    from peft import get_peft_model

    targets = resolve_targets(lm, model_config.target_modules)
    fused = set(lora_experts.expert_parameters(lm))
    parameters = [t for t in targets if t in fused]
    modules = [t for t in targets if t not in parameters]
    # On a mixture-of-experts model peft (0.21, transformers 5) turns `all-linear` and the dense
    # names (gate_proj, up_proj, down_proj, gate) into its `target_parameters` on the fused experts and
    # the routers on its own: it is given the resolved modules and expert parameters by full name.
    # So does peft's `all-linear` on a vision-language model (the vision tower's layers too), and a
    # name such as down_proj would pick Qwen2.5-VL's tower blocks: there it is given the full names too.
    by_name = any(map(is_sparse_block, lm.modules())) or language_model(lm) is not lm
    peft_model = get_peft_model(lm, peft_config(model_config, modules if by_name else model_config.target_modules,
                                                parameters))
    wrapped = lora_experts.wrapped_parameters(lm)
    adapted = sorted(m for m in (module_of(n) for n, _ in lm.named_parameters() if n.endswith(_A)) if m not in wrapped)
    if adapted != sorted(modules) or sorted(wrapped.values()) != sorted(parameters):  # never silently
        raise ConfigError(f"model.target_modules={model_config.target_modules}: peft adapted {len(adapted)} modules "
                          f"and {len(wrapped)} expert parameters, asyncrl resolved {len(modules)} and {len(parameters)}")
    return peft_model


def module_of(name: str) -> str:
    """The module of an adapter parameter's name (`<module>.lora_A.default.weight`)."""
    for suffix in (_A, _B):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise ValueError(f"{name} is not a LoRA A or B weight")


def is_adapter(name: str) -> bool:
    return name.endswith(_A) or name.endswith(_B)


def adapter_tensors(named: Iterable[tuple[str, torch.Tensor]], experts: dict[str, str] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter of the learner's parameters, as generators receive it: `<module>.lora_A`, then
    `<module>.lora_B`, for each adapted module in the model's order. `experts`
    (`lora_experts.wrapped_parameters` of the learner's model): an expert adapter goes by its
    parameter's name instead (`<block>.experts.gate_up_proj.lora_A`)."""
    experts = experts or {}
    for name, tensor in named:
        if is_adapter(name):
            module = module_of(name)
            yield experts.get(module, module) + (".lora_A" if name.endswith(_A) else ".lora_B"), tensor


def adapted_weight(module: str) -> str:
    """The weight an adapter's module (as generators receive it) adapts: `<module>.weight`, or the
    fused expert parameter itself."""
    return module if lora_experts.is_expert_parameter(module) else module + ".weight"


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W0 + scaling * B @ A` (LoRA, Hu et al. 2021, eq. 3), computed in float32 and returned in the
    dtype of `weight`. `weight` `[out, in]`, `a` `[r, in]`, `b` `[out, r]`."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def merge_any(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`merge` of a linear layer's weight, `lora_experts.merge_experts` of fused experts (3-D)."""
    return (lora_experts.merge_experts if weight.dim() == 3 else merge)(weight, a, b, scaling)


def merged_weights(state: dict[str, torch.Tensor], scaling: float, experts: dict[str, str] | None = None
                   ) -> dict[str, torch.Tensor]:
    """The learner's parameters (injected names) as a plain model's, each adapted module's weight
    (and each adapted expert parameter, `experts` as for `adapter_tensors`) merged; other tensors are copied."""
    wrapper_of = {parameter: wrapper for wrapper, parameter in (experts or {}).items()}
    out = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        plain = name.replace(BASE_LAYER, "")  # nested wrappers: <experts>.base_layer.base_layer.down_proj
        module = plain[: -len(".weight")] if name.endswith(BASE_LAYER + ".weight") else wrapper_of.get(plain)
        if module is not None and module + _A in state:
            out[plain] = merge_any(tensor.detach(), state[module + _A].detach(), state[module + _B].detach(), scaling)
        else:
            out[plain] = tensor.detach().clone()
    return out


# --- the generators' side --------------------------------------------------------------------------


class AdapterMerger:
    """A generator's base weights of the adapted modules (`<module>.weight` -> W0, a copy kept
    unmerged in the engine's dtype) and each version's weights from its adapter."""

    def __init__(self, base: dict[str, torch.Tensor]):
        self.base = base

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor], modules: Iterable[str]) -> "AdapterMerger":
        """Copies of the weights `modules` adapt (`adapted_weight`: `<module>.weight`, or a fused expert
        parameter) from `weights` (the engine's weights before any adapter)."""
        return cls({adapted_weight(m): weights[adapted_weight(m)].detach().clone() for m in modules})

    def merged(self, adapter: dict[str, torch.Tensor], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
        """`(<module>.weight, W0 + scaling * B @ A)` for every module of `adapter` (`<module>.lora_A`,
        `<module>.lora_B`), one at a time; a fused expert parameter's own name and `merge_experts`."""
        modules = adapter_modules(adapter)
        unknown = [m for m in modules if adapted_weight(m) not in self.base]
        if unknown:
            raise KeyError(f"adapter names modules whose base this engine does not hold: {unknown[:3]}")
        for module in modules:
            weight = adapted_weight(module)
            yield weight, merge_any(self.base[weight], adapter[module + ".lora_A"], adapter[module + ".lora_B"],
                                    scaling)


def adapter_modules(adapter: dict[str, torch.Tensor]) -> list[str]:
    modules = [name[: -len(".lora_A")] for name in adapter if name.endswith(".lora_A")]
    if len(adapter) != 2 * len(modules) or any(m + ".lora_B" not in adapter for m in modules):
        raise ValueError("an adapter holds a lora_A and a lora_B for each module, nothing else")
    return modules


# --- peft's format on disk ---------------------------------------------------------------------------


def save_adapter(directory: str, peft_model, adapter: dict[str, torch.Tensor], model_config: ModelConfig,
                 tokenizer=None) -> None:
    """`adapter` (the learner's names, whole tensors) in peft's format, with the base model's settings
    and the tokenizer: `PeftModel.from_pretrained(base, directory)` loads it."""
    from asyncrl.storage.images import save_image_processor

    state = {PEFT_PREFIX + name: tensor for name, tensor in adapter.items()}
    peft_model.save_pretrained(directory, state_dict=state, safe_serialization=True)
    with open(os.path.join(directory, MODEL_FILE), "w") as f:
        json.dump(msgspec.to_builtins(model_config), f, indent=1)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    save_image_processor(peft_model.get_base_model(), directory)  # a vision-language model's, as a full checkpoint's


def is_adapter_dir(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, ADAPTER_WEIGHTS))


def read_adapter(directory: str) -> dict[str, torch.Tensor]:
    """An adapter saved in peft's format, by the learner's names (`<module>.lora_A.default.weight`)."""
    from safetensors.torch import load_file

    out = {}
    for name, tensor in load_file(os.path.join(directory, ADAPTER_WEIGHTS)).items():
        module, kind = name.removeprefix(PEFT_PREFIX).rsplit(".", 2)[:2]
        if kind not in ("lora_A", "lora_B") or not name.endswith(".weight"):
            raise ValueError(f"{directory}: {name} is not a LoRA A or B weight")
        out[f"{module}.{kind}.{ADAPTER}.weight"] = tensor
    return out


def saved_model_config(directory: str) -> ModelConfig:
    with open(os.path.join(directory, MODEL_FILE)) as f:
        return msgspec.convert(json.load(f), ModelConfig)


def merged_model(directory: str, trust_remote_code: bool = False):
    """The base model of a saved adapter with the adapter merged into it (a plain transformers
    model), and its tokenizer. `trust_remote_code`: the user's, never the saved settings' (a
    checkpoint is data: its base model's own code runs only when the user says so)."""
    from asyncrl.models.loading import load_policy

    model_config = msgspec.structs.replace(saved_model_config(directory), trust_remote_code=trust_remote_code)
    lm, tokenizer = load_policy(model_config)
    adapter = read_adapter(directory)
    # peft's saved names of expert adapters (`<experts>.base_layer.lora_A`) follow its wrappers' nesting:
    # the model is wrapped as the learner's was to read them, then unwrapped (its base weights untouched).
    peft_model = wrap(lm, model_config)
    experts = lora_experts.wrapped_parameters(lm)
    unknown = sorted(set(adapter) - {name for name, _ in lm.named_parameters() if is_adapter(name)})
    if unknown:
        raise ValueError(f"{directory}: the adapter names modules its saved model.target_modules do not: {unknown[:3]}")
    lm = peft_model.unload()
    weights = dict(lm.named_parameters())
    scaling = model_config.lora_alpha / model_config.lora_rank
    with torch.no_grad():
        for module in sorted({module_of(name) for name in adapter}):
            weight = weights[experts.get(module, module + ".weight")]
            weight.copy_(merge_any(weight, adapter[module + _A], adapter[module + _B], scaling))
    return lm, tokenizer


def export(policy_dir: str, out_dir: str, adapter_only: bool, trust_remote_code: bool = False, dtype: str = "") -> str:
    """`asyncrl export` of a LoRA checkpoint's policy: the merged model as a Hugging Face directory
    in `dtype` (default: the base model directory's, as its config.json names it; else float32;
    merged in the base's loaded dtype, then cast), or (`adapter_only`) the adapter in peft's format
    with the tokenizer and the base's settings. `trust_remote_code`: as `merged_model`."""
    import shutil

    from asyncrl.storage.checkpoint_parts import saved_dtype
    from asyncrl.storage.images import save_image_processor

    if adapter_only:
        shutil.copytree(policy_dir, out_dir, dirs_exist_ok=True)
        return out_dir
    base = saved_model_config(policy_dir)
    dtype = dtype or (base.source == "hf" and saved_dtype(base.path)) or "float32"
    lm, tokenizer = merged_model(policy_dir, trust_remote_code)
    lm.to(getattr(torch, dtype))
    lm.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    save_image_processor(lm, out_dir)  # a vision-language model's (`load_policy` attached it): as a full export's
    return out_dir
