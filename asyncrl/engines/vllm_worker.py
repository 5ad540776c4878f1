"""What asyncrl runs inside vLLM's worker process (named in `worker_extension_cls`, mixed into
vLLM's worker class there, and called by name through the engine's `collective_rpc`).

vLLM's CPU build packs each linear layer's weight into its GEMM kernel's layout at load and drops
the plain weight (`dispatch_cpu_unquantized_gemm`), so copying into the model's parameters would
change nothing the forward reads. Each version is therefore loaded through vLLM's own in-place
reload (`model_runner.reload_weights`: the model's `load_weights` from checkpoint names, then every
layer processed again as at start-up), which repacks it.

* `asyncrl_load_tensors`: a version carried in the call itself, as one safetensors blob (vLLM's
  RPC encoder carries bytes whole but not tensors nested in lists): the cross-node group path, or a
  direct call.
* `asyncrl_load_shared`: a version in the node's shared memory (`asyncrl.weights.sync`'s slot
  files): the call carries the file's layout, the worker maps the file and reads from it, so names
  and offsets cross processes, not the weights.
"""

from __future__ import annotations

import msgspec

from asyncrl.weights.shared_memory import SharedVersion, shared_views


class WeightLoading:
    """Mixed into vLLM's worker: `self.model_runner` is its model runner."""

    def asyncrl_load_tensors(self, blob: bytes) -> int:
        """Load every tensor of a version (Hugging Face names, as the learner's model has them),
        `blob` being them in safetensors' format."""
        from safetensors.torch import load

        named = list(load(blob).items())
        self.model_runner.reload_weights(weights_iterator=iter(named))
        return len(named)

    def asyncrl_load_shared(self, layout: bytes) -> int:
        """Load a version from its slot file; `layout` is `SharedVersion` as msgpack."""
        version = msgspec.msgpack.decode(layout, type=SharedVersion)
        named = shared_views(version)
        self.model_runner.reload_weights(weights_iterator=iter(named))
        return len(named)
