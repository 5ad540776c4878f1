"""SGLang in the broadcast benchmark (in .venv-sglang, with `engine=sglang_cpu` or `engine=sglang`;
`asyncrl bench engine` there is `asyncrl.bench.server_bench`'s):

* `asyncrl bench broadcast engine=sglang_cpu`: a weight update into a running SGLang engine by its
  two paths, beside the embedded engine's `shm`: `sglang_shm` (the version written to the learner's
  shared-memory slot, SGLang's scheduler maps it and copies it into its parameters) and
  `sglang_tensors` (the tensors themselves through `update_weights_from_tensor`, as a generator on
  another node loads what it received). Each update is checked: SGLang's copy of the changed tensor
  is read back.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from asyncrl.bench.server_bench import LoopEngine
from asyncrl.config import Config
from asyncrl.weights.shared_memory import SharedSlots


def first_values(sglang: LoopEngine, name: str, count: int) -> np.ndarray:
    """The first values of SGLang's copy of a parameter (read back from its scheduler)."""
    from sglang.srt.managers.io_struct import GetWeightsByNameReqInput

    values = sglang.call(sglang.engine.engine.tokenizer_manager.get_weights_by_name(
        GetWeightsByNameReqInput(name=name, truncate_size=count), None))
    return np.asarray(values, dtype=np.float32).reshape(-1)[:count]


def update_speed(config: Config, rounds: int, memcpy_seconds) -> dict:
    """Seconds per update into an idle SGLang engine by each path, beside a copy of the same bytes
    (`memcpy_seconds(bytes, rounds)`, the broadcast benchmark's ceiling)."""
    from asyncrl.models.loading import load_policy

    model, _ = load_policy(config.model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    probe = "model.embed_tokens.weight"
    sglang = LoopEngine(config)
    slots = SharedSlots()
    out = {}
    try:
        for path in ("sglang_shm", "sglang_tensors"):
            times = []
            for _ in range(rounds):
                weights[probe].add_(1.0)  # every version differs: read back below
                version = sglang.engine.weight_version + 1
                start = time.perf_counter()
                if path == "sglang_shm":
                    sglang.engine.adopt_shared(slots.write(weights.items()), version)
                else:
                    sglang.engine.update_weights(list(weights.items()), version)
                times.append(time.perf_counter() - start)
                landed = first_values(sglang, probe, 8)
                if not np.allclose(landed, weights[probe].reshape(-1)[:8].numpy(), atol=1e-6):
                    raise RuntimeError(f"{path}: SGLang holds other weights than version {version}")
            copy = statistics.median(memcpy_seconds(total, rounds))
            out[path] = {"parameters": sum(t.numel() for t in weights.values()), "bytes": total, "rounds": rounds,
                         "seconds_per_update_median": statistics.median(times), "first_update_s": times[0],
                         "bytes_per_s_median": total / statistics.median(times), "memcpy_s_median": copy,
                         "memcpy_bytes_per_s_median": total / copy,
                         "memcpy_bandwidth_share": copy / statistics.median(times)}
    finally:
        slots.close()
        sglang.close()
    return out
