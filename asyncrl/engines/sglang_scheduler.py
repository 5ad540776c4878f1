"""What asyncrl runs inside SGLang's scheduler process (imported there by reference, by name).

* `TruncatedSampling`: a custom logit processor that cuts each row's logits to its top-k / top-p
  set with the sampler's own `filtered_logprobs`. SGLang returns the log-probs of
  `softmax(logits / T)` and does not renormalise after its own top-k/top-p, so a token drawn under
  them would carry the log-prob of a distribution it was not drawn from. With the cut made here
  and SGLang's own top-k/top-p off, SGLang samples from `softmax(cut / T)`, exactly the
  distribution the learner scores (`asyncrl.learning.token_logprobs`), and returns its log-prob.
* `load_shared`: SGLang's weight loader for a version in the node's shared memory
  (`asyncrl.weights.sync`'s slot files): the update carries the file's layout, SGLang's scheduler
  maps the file and copies from it, so names and offsets cross processes, not the weights.
"""

from __future__ import annotations

import msgspec
import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

from asyncrl.algo.sampling import filtered_logprobs
from asyncrl.weights.shared_memory import SharedVersion, shared_views


class TruncatedSampling(CustomLogitProcessor):
    """Per row `custom_params` `{"temperature": T, "top_k": k, "top_p": p, "min_p": m}`: logits outside
    the sampler's top-k / top-p / min-p set (at temperature T, as the sampler cuts them) become -inf."""

    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict] | None = None) -> torch.Tensor:
        settings = [(p["temperature"], p["top_k"], p["top_p"], p.get("min_p", 0.0)) for p in custom_param_list]
        # Rows of one run share their settings (two sets with FIRE): one call per distinct set.
        for key in set(settings):
            rows = torch.tensor([i for i, s in enumerate(settings) if s == key], device=logits.device)
            kept = torch.isfinite(filtered_logprobs(logits[rows], *key))
            logits[rows] = logits[rows].masked_fill(~kept, float("-inf"))
        return logits


def truncation(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> dict:
    return {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p), "min_p": float(min_p)}


# SGLang's weight loader for `shared_payload`, named in the engine's `custom_weight_loader`.
SHARED_LOADER = f"{__name__}.load_shared"
_LAYOUT = "asyncrl-shared-version"
_CODEC = msgspec.msgpack


def shared_payload(version: SharedVersion) -> list[tuple[str, torch.Tensor]]:
    """A version in a slot file as what `update_weights_from_tensor` carries: its layout, encoded
    into one small uint8 tensor (SGLang's unpickler admits tensors, not our classes)."""
    return [(_LAYOUT, torch.frombuffer(bytearray(_CODEC.encode(version)), dtype=torch.uint8))]


def load_shared(model, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """In SGLang's scheduler: map the slot file (once per file: `shared_views` keeps the mapping)
    and load the version's tensors from it, one copy into the model's parameters."""
    (name, encoded), = named_tensors
    if name != _LAYOUT:
        raise ValueError(f"{SHARED_LOADER} loads a shared-memory version, got a tensor named {name!r}")
    version = _CODEC.decode(encoded.cpu().numpy().tobytes(), type=SharedVersion)
    model.load_weights(shared_views(version))
