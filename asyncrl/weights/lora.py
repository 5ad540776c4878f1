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
    and an adapted router would move the choices it replays."""
    skip = {id(output_head(model))} | {id(module.gate) for module in model.modules() if is_sparse_block(module)}
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and id(module) not in skip]


def is_sparse_block(module: torch.nn.Module) -> bool:
    """A mixture-of-experts block: experts behind a router (`experts`, `gate`)."""
    return isinstance(getattr(module, "experts", None), torch.nn.Module) and isinstance(
        getattr(module, "gate", None), torch.nn.Module)


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def resolve_targets(model: torch.nn.Module, targets: str | list[str]) -> list[str]:
    """The full names of the modules `targets` selects (`all-linear`, or names that a module's name
    is or ends with, as peft matches them). The output head is adapted only when named and not tied
    to the input embedding. A name that selects nothing is refused, naming the modules the model has."""
    modules = adaptable_modules(model)
    if targets == "all-linear":
        return modules
    head = output_head(model)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if isinstance(head, torch.nn.Linear) and not tied:
        modules += [name for name, module in model.named_modules() if module is head]
    missing = [t for t in targets if not any(m == t or m.endswith("." + t) for m in modules)]
    if missing:
        have = sorted({m.rsplit(".", 1)[-1] for m in modules})
        tied = " (its output head is tied to the input embedding: not adaptable)" if tied else ""
        moe = ("; on a mixture-of-experts model LoRA adapts neither the experts (3-D parameters, not linear "
               "layers) nor the routers (routing replay)") if any(map(is_sparse_block, model.modules())) else ""
        raise ConfigError(f"model.target_modules: {type(model).__name__} has no linear module named "
                          f"{', '.join(missing)}; the modules LoRA can adapt are {', '.join(have)}{tied}{moe}")
    return [m for m in modules if any(m == t or m.endswith("." + t) for t in targets)]


def check_targets(model_config: ModelConfig) -> list[str]:
    """At start-up: the target modules of `model_config` against its architecture (built on the meta
    device: no weights are read). Raises `ConfigError` naming the modules it has."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.models.loading import build_tiny_model, build_tiny_tokenizer, embedded_gguf_dir

    with torch.device("meta"):
        if model_config.source == "tiny":
            skeleton = build_tiny_model(model_config, len(build_tiny_tokenizer()))
        else:
            if model_config.source == "gguf":
                config = AutoConfig.from_pretrained(model_config.path or embedded_gguf_dir(),
                                                    gguf_file=model_config.gguf_file)
            else:
                config = AutoConfig.from_pretrained(model_config.path, trust_remote_code=model_config.trust_remote_code)
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=model_config.trust_remote_code)
    return resolve_targets(skeleton, model_config.target_modules)


# --- the learner's side ----------------------------------------------------------------------------


def peft_config(model_config: ModelConfig, targets: list[str] | str):
    from peft import LoraConfig

    return LoraConfig(r=model_config.lora_rank, lora_alpha=model_config.lora_alpha, target_modules=targets,
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def wrap(lm, model_config: ModelConfig):
    """peft's LoRA on `lm`, in place: returns the `PeftModel` (saving, peft's own state dicts); `lm`
    itself is the model the learner trains (`PeftModel.get_base_model()`), its base weights frozen."""
    from peft import get_peft_model

    targets = resolve_targets(lm, model_config.target_modules)
    # On a mixture-of-experts model peft (0.21, transformers 5) turns `all-linear` and the dense
    # names (gate_proj, up_proj, down_proj, gate) into its `target_parameters` on the fused experts and
    # the routers, which the merge path here does not carry: it is given the resolved modules by name.
    moe = any(map(is_sparse_block, lm.modules()))
    peft_model = get_peft_model(lm, peft_config(model_config, targets if moe else model_config.target_modules))
    adapted = sorted(module_of(name) for name, _ in lm.named_parameters() if name.endswith(_A))
    if adapted != sorted(targets):  # peft matched other modules than we would merge: never silently
        raise ConfigError(f"model.target_modules={model_config.target_modules}: peft adapted {len(adapted)} "
                          f"modules, asyncrl resolved {len(targets)}")
    return peft_model


def module_of(name: str) -> str:
    """The module of an adapter parameter's name (`<module>.lora_A.default.weight`)."""
    for suffix in (_A, _B):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise ValueError(f"{name} is not a LoRA A or B weight")


def is_adapter(name: str) -> bool:
    return name.endswith(_A) or name.endswith(_B)


def adapter_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter of the learner's parameters, as generators receive it: `<module>.lora_A`, then
    `<module>.lora_B`, for each adapted module in the model's order."""
    for name, tensor in named:
        if name.endswith(_A):
            yield module_of(name) + ".lora_A", tensor
        elif name.endswith(_B):
            yield module_of(name) + ".lora_B", tensor


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W0 + scaling * B @ A` (LoRA, Hu et al. 2021, eq. 3), computed in float32 and returned in the
    dtype of `weight`. `weight` `[out, in]`, `a` `[r, in]`, `b` `[out, r]`."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def merged_weights(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The learner's parameters (injected names) as a plain model's, each adapted module's weight
    merged; other tensors are copied."""
    out = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if name.endswith(BASE_LAYER + ".weight") and (module := name[: -len(BASE_LAYER + ".weight")]) + _A in state:
            out[module + ".weight"] = merge(tensor.detach(), state[module + _A].detach(), state[module + _B].detach(),
                                            scaling)
        else:
            out[name.replace(BASE_LAYER + ".", ".")] = tensor.detach().clone()
    return out


# --- the generators' side --------------------------------------------------------------------------


class AdapterMerger:
    """A generator's base weights of the adapted modules (`<module>.weight` -> W0, a copy kept
    unmerged in the engine's dtype) and each version's weights from its adapter."""

    def __init__(self, base: dict[str, torch.Tensor]):
        self.base = base

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor], modules: Iterable[str]) -> "AdapterMerger":
        """Copies of `weights[<module>.weight]` for `modules` (the engine's weights before any adapter)."""
        return cls({m + ".weight": weights[m + ".weight"].detach().clone() for m in modules})

    def merged(self, adapter: dict[str, torch.Tensor], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
        """`(<module>.weight, W0 + scaling * B @ A)` for every module of `adapter` (`<module>.lora_A`,
        `<module>.lora_B`), one at a time."""
        modules = adapter_modules(adapter)
        unknown = [m for m in modules if m + ".weight" not in self.base]
        if unknown:
            raise KeyError(f"adapter names modules whose base this engine does not hold: {unknown[:3]}")
        for module in modules:
            yield module + ".weight", merge(self.base[module + ".weight"], adapter[module + ".lora_A"],
                                            adapter[module + ".lora_B"], scaling)


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
    state = {PEFT_PREFIX + name: tensor for name, tensor in adapter.items()}
    peft_model.save_pretrained(directory, state_dict=state, safe_serialization=True)
    with open(os.path.join(directory, MODEL_FILE), "w") as f:
        json.dump(msgspec.to_builtins(model_config), f, indent=1)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


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
    weights = dict(lm.named_parameters())
    scaling = model_config.lora_alpha / model_config.lora_rank
    with torch.no_grad():
        for module in sorted({module_of(name) for name in adapter}):
            weight = weights[module + ".weight"]
            weight.copy_(merge(weight, adapter[module + _A], adapter[module + _B], scaling))
    return lm, tokenizer


def export(policy_dir: str, out_dir: str, adapter_only: bool, trust_remote_code: bool = False, dtype: str = "") -> str:
    """`asyncrl export` of a LoRA checkpoint's policy: the merged model as a Hugging Face directory
    in `dtype` (default: the base model directory's, as its config.json names it; else float32;
    merged in the base's loaded dtype, then cast), or (`adapter_only`) the adapter in peft's format
    with the tokenizer and the base's settings. `trust_remote_code`: as `merged_model`."""
    import shutil

    from asyncrl.storage.checkpoint_parts import saved_dtype

    if adapter_only:
        shutil.copytree(policy_dir, out_dir, dirs_exist_ok=True)
        return out_dir
    base = saved_model_config(policy_dir)
    dtype = dtype or (base.source == "hf" and saved_dtype(base.path)) or "float32"
    lm, tokenizer = merged_model(policy_dir, trust_remote_code)
    lm.to(getattr(torch, dtype))
    lm.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
