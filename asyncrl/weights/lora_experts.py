"""LoRA on the experts of a mixture-of-experts model (`asyncrl.weights.lora`'s expert half).

transformers 5 holds a sparse block's experts as two fused 3-D parameters, `<block>.experts.gate_up_proj`
`[E, 2 * intermediate, hidden]` and `<block>.experts.down_proj` `[E, hidden, intermediate]` (Mixtral,
Qwen2-MoE, Qwen3-MoE), not as linear layers. peft adapts such a parameter through its
`target_parameters` (`peft.tuners.lora.layer.ParamWrapper`): one adapter per parameter, rank r per
expert, `lora_A` `[r * E, in]` and `lora_B` `[out, r * E]` (in = the last axis, out = the middle one).

They are adapted only when named with their module, `experts.gate_up_proj` / `experts.down_proj`
(or a longer end of the full name): a bare `down_proj` keeps selecting the linear layers of that name
(Qwen2-MoE's shared expert, a dense layer's MLP), as it did before experts could be adapted.

Names: peft nests one wrapper per adapted parameter in place of the experts module (the learner's
adapter is `<experts>[.base_layer].lora_A.default.weight`, which says nothing of which parameter);
`wrapped_parameters` reads the wrappers for that. The generators know the parameter itself,
`<block>.experts.gate_up_proj` (no `.weight`), and so do the adapter's names on the wire
(`<block>.experts.gate_up_proj.lora_A`).
"""

from __future__ import annotations

import torch

PROJECTIONS = ("gate_up_proj", "down_proj")


def is_sparse_block(module: torch.nn.Module) -> bool:
    """A mixture-of-experts block: experts behind a router (`experts`, `gate`)."""
    return isinstance(getattr(module, "experts", None), torch.nn.Module) and isinstance(
        getattr(module, "gate", None), torch.nn.Module)


def expert_parameters(model: torch.nn.Module) -> list[str]:
    """Full names of the fused expert projections LoRA can adapt, in the model's order. Experts
    stored transposed (`is_transposed`) are left out: peft reads in and out the other way round there,
    and the embedded engine does not run them."""
    out = []
    for name, module in model.named_modules():
        if is_sparse_block(module) and not getattr(module.experts, "is_transposed", False):
            for projection in PROJECTIONS:
                param = getattr(module.experts, projection, None)
                if isinstance(param, torch.Tensor) and param.dim() == 3:
                    out.append(f"{name}.experts.{projection}" if name else f"experts.{projection}")
    return out


def selects(target: str, parameter: str) -> bool:
    """Whether a `model.target_modules` name selects an expert parameter: the parameter's name is it
    or ends with it, and it names the experts module too (`experts.down_proj`, never a bare `down_proj`)."""
    return "." in target and (parameter == target or parameter.endswith("." + target))


def is_expert_parameter(name: str) -> bool:
    """A fused expert projection's name (`<block>.experts.gate_up_proj`), as generators know it."""
    return name.rsplit(".", 2)[-2:] in (["experts", p] for p in PROJECTIONS)


def routers(model: torch.nn.Module) -> list[str]:
    """Full names of the routers (`<block>.gate`) of the model's mixture-of-experts blocks."""
    return [f"{name}.gate" if name else "gate" for name, module in model.named_modules() if is_sparse_block(module)]


def wrapped_parameters(lm: torch.nn.Module) -> dict[str, str]:
    """After `lora.wrap`: each peft parameter wrapper's module name (where its `lora_A`/`lora_B`
    hang: `<block>.experts`, `<block>.experts.base_layer`, ...) -> the full name of the parameter it
    adapts in the plain model (`<block>.experts.gate_up_proj`)."""
    from peft.tuners.lora.layer import ParamWrapper

    return {name: f"{name.replace('.base_layer', '')}.{module.parameter_name}"
            for name, module in lm.named_modules() if isinstance(module, ParamWrapper)}


def merge_experts(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W0[e] + scaling * B_e @ A_e` for every expert e, computed in float32 and returned in the dtype
    of `weight`, with peft's layout of the factors (`ParamWrapper.get_delta_weight`, experts not
    transposed): `weight` `[E, out, in]`, `a` `[r * E, in]` read as `A_e = a.reshape(E, r, in)[e]`,
    `b` `[out, r * E]` read as `B_e = b.reshape(out, r, E)[:, :, e]` (the experts interleaved on
    that axis, not in blocks), so that `delta = einsum('o r e, e r i -> e o i', B, A)`."""
    experts, out, inp = weight.shape
    if a.shape[-1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1] or a.shape[0] % experts:
        raise ValueError(f"an expert adapter of A {tuple(a.shape)}, B {tuple(b.shape)} does not fit experts "
                         f"{tuple(weight.shape)}")
    a3 = a.float().reshape(experts, -1, inp)
    b3 = b.float().reshape(out, -1, experts)
    return (weight.float() + scaling * torch.einsum("o r e, e r i -> e o i", b3, a3)).to(weight.dtype)
