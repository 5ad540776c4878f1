"""SGLang behind the engine interface (`engine=sglang`: on the GPU torch sees, else on the CPU).

SGLang's offline `Engine` runs in the generator's process: its tokenizer manager on the
generator's event loop, its scheduler and detokenizer in subprocesses. Built by
`asyncrl.engines.sglang_launch.start_sglang`.

Windows, FIRE, minimum lengths and weight updates mid-request are `server_engine.ServerEngine`'s;
here, SGLang's side of them:

* A window's request: `max_new_tokens` = what is left of the window, `min_new_tokens`, the EOS ids
  as stop tokens, per-token log-probs; the radix cache serves the re-sent prefix.
* Log-probs are those of the distribution each token was drawn from: top-k / top-p are cut in the
  scheduler by `TruncatedSampling` (SGLang's own returned log-probs are not renormalised after them).
* A weight update aborts the requests in flight and loads in SGLang's weight-update session (begin,
  update, end). Pausing in place would keep the old KV of running requests, and a retract re-reads
  the radix cache's old prefix (both measured: docs/gpu.md). Each token's version is the one
  SGLang's weight-version spans give it.
* A mixture-of-experts model's routes (`sglang_routes.RouteLayout`, when SGLang was started with
  `--enable-return-routed-experts`): each request asks for those of its new tokens. A request cut
  by an update comes back with its tokens' routes too (SGLang 0.5.23, tests/test_sglang_real.py);
  one that comes back without them, or with a record of another length, leaves its tokens unrouted.
* Top log-probs (`SamplingParams.top_logprobs`) are SGLang's `top_logprobs_num`, from the same
  distribution as the sampled token's (after the cut: -inf for a token it leaves out).
* A LoRA version (`load_adapter`) is merged here, in the generator's process, into the base weights
  of its modules (read once from the model directory SGLang loaded), and the merged modules go
  through the same weight update. SGLang 0.5.23's own LoRA backends are GPU kernels (triton, csgmv,
  triton_v2, uno_cublas) or Ascend's, and its `torch_native` one pins host memory for every batch
  (`pin_memory=True`), which raises without a CUDA driver; a merged model also decodes at the base
  model's speed.
"""

from __future__ import annotations

from typing import Iterable

import torch

from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.engines.server_engine import ServerEngine, Setting, WindowTokens, read_weights
from asyncrl.engines.sglang_routes import RouteLayout
from asyncrl.weights.shared_memory import SharedVersion


def take_output(out: WindowTokens, result: dict, top_n: int, routes: RouteLayout | None = None) -> str:
    """Append a SGLang request's output to `out` (with `routes`, its tokens' routes); returns SGLang's
    finish type (stop, length, abort)."""
    meta, new = result["meta_info"], list(result["output_ids"])
    logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
    versions = [int(span["version"]) for span in meta["weight_versions"] for _ in range(span["start"], span["end"])]
    top = [[(float(e[0]), int(e[1])) for e in entries] for entries in meta.get("output_top_logprobs") or []]
    if not len(logprobs) == len(versions) == len(new) or top_n and len(top) != len(new):
        raise RuntimeError(f"SGLang returned {len(new)} tokens, {len(logprobs)} log-probs, {len(top)} top "
                           f"log-probs and {len(versions)} versions for request {meta['id']}")
    out.ids += new
    out.logprobs += logprobs
    out.versions += versions
    out.top += top
    finish = meta["finish_reason"]["type"]
    if routes is not None:
        recorded = routes.decode(meta.get("routed_experts"))
        if recorded is not None and len(recorded) != len(new):
            if finish != "abort":
                raise RuntimeError(f"SGLang returned {len(new)} tokens and {len(recorded)} routes for request "
                                   f"{meta['id']}")
            recorded = None  # an aborted request's partial record: its tokens stay unrouted
        out.routes.append((recorded, len(new)))
    return finish


class SGLangEngine(ServerEngine):
    server = "SGLang"

    def __init__(self, server_args: dict, eos_token_ids: Iterable[int], routes: RouteLayout | None = None):
        """`server_args`: SGLang's `ServerArgs` fields (`sglang_launch.server_args`); `routes`: a
        mixture-of-experts model's, which SGLang captures (`enable_return_routed_experts`)."""
        # Imported here, never at package import: importing SGLang installs uvloop's event-loop
        # policy and sets multiprocessing's start method to spawn (ecosystem §2.4).
        import sglang
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer

        from asyncrl.engines.sglang_scheduler import SHARED_LOADER, TruncatedSampling

        super().__init__(eos_token_ids)
        self.io = io_struct
        self.serializer = MultiprocessingSerializer
        self.tp_size = int(server_args["tp_size"])
        self.model_path = server_args["model_path"]
        self.routes = routes
        self._lora = None  # `asyncrl.weights.lora.AdapterMerger`, from the first adapter on
        self.truncation = TruncatedSampling.to_str()
        # The initial version as an integer string: SGLang's default is "default", and every
        # token's weight-version span carries it.
        self.engine = sglang.Engine(**server_args, weight_version="0", enable_custom_logit_processor=True,
                                    custom_weight_loader=[SHARED_LOADER])

    # --- generation -------------------------------------------------------------------------------

    def _sampling(self, max_new: int, min_new: int, seed: int, setting: Setting,
                  params: SamplingParams | None = None) -> dict:
        """SGLang's sampling parameters (`sglang.srt.sampling.sampling_params.SamplingParams`) for
        `setting` (temperature, top-k, top-p, min-p; temperature 0 is greedy: argmax, the log-prob
        that of softmax(logits)). Its own top-k / top-p / min-p stay off: `TruncatedSampling` cuts
        the logits (`custom_params`), as our sampler does."""
        from asyncrl.engines.sglang_scheduler import truncation

        temperature, top_k, top_p, min_p = setting
        sampling = {"max_new_tokens": max_new, "min_new_tokens": min(min_new, max_new), "temperature": temperature,
                    "stop_token_ids": self.eos_token_ids, "sampling_seed": seed}
        if params is not None and params.adjusts_logits:  # the policy endpoint's penalties and bias
            sampling.update(presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                            logit_bias={str(i): b for i, b in params.logit_bias} or None)
        if temperature > 0 and (top_k > 0 or top_p < 1.0 or min_p > 0):
            sampling["custom_params"] = truncation(temperature, top_k, top_p, min_p)
        return sampling

    def request_fields(self, sampling: dict, top_n: int, version: int) -> dict:
        """`Engine.async_generate`'s arguments besides the input ids and the request id."""
        return {"sampling_params": sampling, "return_logprob": True, "logprob_start_len": -1,
                "top_logprobs_num": top_n, "cache_salt": f"asyncrl-v{version}",
                "custom_logit_processor": self.truncation if "custom_params" in sampling else None}

    async def _send(self, rid: str, input_ids: list[int], sampling: dict, out: WindowTokens, top_n: int,
                    version: int) -> tuple[str | None, int]:
        routes = {} if self.routes is None else self.routes.request_fields(len(input_ids))
        result = await self.engine.async_generate(input_ids=input_ids, rid=rid, **routes,
                                                  **self.request_fields(sampling, top_n, version))
        # Each token's version is the one SGLang's weight-version spans give it.
        finish = take_output(out, result, top_n, self.routes)
        # A request aborted before the scheduler took it has no `cached_tokens`: nothing was read.
        return finish, result["meta_info"].get("cached_tokens", 0)

    async def _abort_inflight(self) -> None:
        self.engine.tokenizer_manager.abort_request(abort_all=True)

    def stream_window(self, sequences, window_tokens, params):
        raise NotImplementedError("SGLangEngine streams whole responses (`stream`, the policy endpoint's); "
                                  "generators advance windows (generate_window)")

    def stream(self, sequences: list[SequenceInput], params: SamplingParams):
        """Whole responses of `sequences`, streamed as SGLang samples them (the policy endpoint):
        `asyncrl.engines.sglang_stream.SGLangSteps`. Continuous batching is SGLang's own."""
        from asyncrl.engines.sglang_stream import SGLangSteps

        self._bind()
        return SGLangSteps(self, sequences, params)

    @property
    def context_tokens(self) -> int:
        """The model's context length, as SGLang's tokenizer manager checks it."""
        return int(self.engine.tokenizer_manager.context_len)

    # --- weights ----------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights by tensor (CUDA IPC handles on a GPU, shared memory on CPU) while
        requests run. Called from a worker thread: SGLang's calls are coroutines on its loop."""
        self._run(self._load(list(named_tensors), version))

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter, version: int) -> None:
        """A LoRA version: merged here into the base of its modules (`asyncrl.weights.lora.AdapterMerger`),
        then loaded like any version (only the adapted modules' weights)."""
        from asyncrl.weights.lora import AdapterMerger, adapted_weight, adapter_modules

        tensors = {name: t.clone() for name, t in named_tensors}
        if self._lora is None:
            weights = [adapted_weight(m) for m in adapter_modules(tensors)]
            if any(not w.endswith(".weight") for w in weights):  # refused at start-up too (lora.check_targets)
                raise NotImplementedError("LoRA on the fused experts needs engine=torch: SGLang's checkpoint "
                                          "holds them one expert at a time")
            self._lora = AdapterMerger(read_weights(self.model_path, weights))
        self._run(self._load(list(self._lora.merged(tensors, adapter.scaling)), version))

    def adopt_shared(self, shared: SharedVersion, version: int) -> None:
        """Load a version from the node's shared-memory slot (`asyncrl.weights.shared_memory.SharedSlots`):
        SGLang's scheduler maps the file and copies from it (`sglang_scheduler.load_shared`)."""
        from asyncrl.engines.sglang_scheduler import SHARED_LOADER, shared_payload

        self._run(self._load(shared_payload(shared), version, SHARED_LOADER))

    async def _load(self, named: list, version: int, load_format: str | None = None) -> None:
        io, manager = self.io, self.engine.tokenizer_manager

        async def load():
            payload = [self.serializer.serialize(named) for _ in range(self.tp_size)]
            await _succeed(manager.begin_weight_update(io.BeginWeightUpdateReqInput(), None), "begin_weight_update")
            try:
                await _succeed(manager.update_weights_from_tensor(io.UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=payload, load_format=load_format, flush_cache=False,
                    weight_version=str(version)), None), f"update_weights_from_tensor (version {version})")
            finally:
                await _succeed(manager.end_weight_update(io.EndWeightUpdateReqInput(), None), "end_weight_update")

        await self._swap(load, version)

    def shutdown(self) -> None:
        self.engine.shutdown()


async def _succeed(call, what: str) -> None:
    ok, message = await call
    if not ok:
        raise RuntimeError(f"SGLang refused {what}: {message}")

