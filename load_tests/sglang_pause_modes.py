"""Which way of updating SGLang's weights mid-request gives tokens that follow the new weights?

    .venv-sglang/bin/python load_tests/sglang_pause_modes.py            # CPU (SGLANG_USE_CPU_ENGINE=1)
    .venv-sglang/bin/python load_tests/sglang_pause_modes.py --device cuda

One SGLang engine on the tiny random model (`model=tiny`, float32). For each mode a 1,000-token
request runs (EOS not stopping it), and a second of the way in the weights change to a perturbed
copy inside SGLang's weight-update session:

* `in_place`: pause in place, load, continue (the running request keeps its KV cache);
* `retract`: pause with retract, load, continue (the request goes back to the waiting queue and is
  prefilled again, under its old `cache_salt`);
* `resubmit`: abort the request, load, send its remainder with the tokens so far as prefix and a
  new `cache_salt` (what `asyncrl.engines.sglang_engine` does).

Every token's log-prob is then compared with the learner's (`asyncrl.learning.response_logprobs`,
a full forward of the whole sequence) under the weights of the version SGLang reports for it.
Prints one JSON line per mode: tokens per version, the largest difference per version, the update's
seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np
import torch

LENGTH = 1000


def _perturbed(model, seed: int):
    other = type(model)(model.config).float().eval()
    other.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return other


async def _one(engine, mode: str, prompt: list[int], new_model, version: int) -> tuple[list, list, list, float]:
    from sglang.srt.managers import io_struct as io
    from sglang.srt.utils import MultiprocessingSerializer

    manager = engine.tokenizer_manager
    sampling = {"max_new_tokens": LENGTH, "temperature": 1.0, "ignore_eos": True}

    def send(ids, budget, salt):
        return engine.async_generate(input_ids=ids, sampling_params=dict(sampling, max_new_tokens=budget),
                                     return_logprob=True, logprob_start_len=-1, cache_salt=salt)

    request = asyncio.ensure_future(send(prompt, LENGTH, f"v{version - 1}"))
    await asyncio.sleep(1.0)
    start = time.perf_counter()
    if mode == "resubmit":
        manager.abort_request(abort_all=True)
        first = await request
    else:
        await manager.pause_generation(io.PauseGenerationReqInput(mode=mode))
    payload = [MultiprocessingSerializer.serialize(list(new_model.named_parameters()))]
    for call in (manager.begin_weight_update(io.BeginWeightUpdateReqInput(), None),
                 manager.update_weights_from_tensor(io.UpdateWeightsFromTensorReqInput(
                     serialized_named_tensors=payload, flush_cache=False, weight_version=str(version)), None),
                 manager.end_weight_update(io.EndWeightUpdateReqInput(), None)):
        ok, message = await call
        if not ok:
            raise RuntimeError(message)
    if mode != "resubmit":
        await manager.continue_generation(io.ContinueGenerationReqInput(torch_empty_cache=False))
    seconds = time.perf_counter() - start
    outputs = [first, await send(prompt + list(first["output_ids"]), LENGTH - len(first["output_ids"]), f"v{version}")] \
        if mode == "resubmit" else [await request]
    ids, logprobs, versions = [], [], []
    for out in outputs:
        meta = out["meta_info"]
        ids += list(out["output_ids"])
        logprobs += [entry[0] for entry in meta["output_token_logprobs"]]
        versions += [int(s["version"]) for s in meta["weight_versions"] for _ in range(s["start"], s["end"])]
    return ids, logprobs, versions, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import sglang

    from asyncrl.config import compose
    from asyncrl.engines.sglang_launch import hf_directory
    from asyncrl.learning.scoring import response_logprobs
    from asyncrl.models.loading import load_policy

    config = compose(["model=tiny", "model.max_positions=2048"])
    models = {0: load_policy(config.model)[0]}
    engine = sglang.Engine(model_path=hf_directory(config.model), device=args.device, dtype="float32",
                           mem_fraction_static=0.3, max_total_tokens=8192, weight_version="0", log_level="error")
    prompt = [3, 4, 5, 6, 7, 8]
    for mode in ("in_place", "retract", "resubmit"):
        version = max(models) + 1
        models[version] = _perturbed(models[version - 1], version)
        ids, logprobs, versions, seconds = engine.loop.run_until_complete(
            _one(engine, mode, prompt, models[version], version))
        report = {"mode": mode, "update_s": round(seconds, 3)}
        for v in sorted(set(versions)):
            learner = response_logprobs(models[v], [(np.asarray(prompt), np.asarray(ids))], 1.0)[0]
            mine = np.asarray(versions) == v
            report[f"v{v}"] = {"tokens": int(mine.sum()),
                               "max_abs_diff": float(np.abs(np.asarray(logprobs)[mine] - learner[mine]).max())}
        print(json.dumps(report), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
