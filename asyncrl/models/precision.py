"""bfloat16 or float32: the `auto` rule of `engine.dtype`, `policy.compute.precision` and
`critic.compute.precision`, decided by measuring this machine, not by its CPU flags.

A CPU's flags say little about speed: with AMX a Xeon runs the embedded model's bf16 matmuls 3.5x
faster than fp32, an AMD EPYC with AVX512-BF16 gains far less, and one without it (AVX2 only)
emulates bf16 at an eighth of fp32's speed; a GPU without native bf16 emulates it too. So every
role that has `auto` times the model's own linear shapes in both dtypes at start-up (a fraction
of a second) and takes bf16 only where it is clearly faster. Every role calls `choose_precision`;
each logs its choice and reports it in its stats.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Below this many parameters a model stays fp32 without a probe: its steps are fixed costs, and
# the casts add to them (the tiny 0.14M-parameter model generates 16% slower in bf16 and trains
# at 0.7x, on a CPU whose bf16 matmuls are 3.5x fp32's).
BF16_MIN_PARAMETERS = 10_000_000
# bf16 must make the model's matmuls at least this much faster: the rest of a step (norms and
# softmax in fp32, casts, sampling) does not speed up, and bf16 moves the engine's distribution
# away from the fp32 learner's (the rollout mismatch), so a small gain is not worth it.
BF16_MIN_SPEEDUP = 1.25
# The probe's widest weight: wider layers (the LM head) are timed on this many output columns and
# scaled, which keeps the probe short where bf16 is emulated.
PROBE_MAX_COLUMNS = 4096
PROBE_MIN_SECONDS = 0.005  # each timing loops for at least this long


@dataclass(frozen=True)
class Precision:
    """A role's precision: bf16 or fp32, why, and what the probe measured (None: no probe)."""

    bf16: bool
    reason: str
    fp32_ms: float | None = None  # the model's matmuls at the probed rows, once each, in fp32
    bf16_ms: float | None = None

    @property
    def name(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    def summary(self) -> dict:
        """The choice and why, for a role's stats (the run's status)."""
        return {"precision": self.name, "reason": self.reason, "probe_fp32_ms": self.fp32_ms,
                "probe_bf16_ms": self.bf16_ms}


def choose_precision(setting: str, model: torch.nn.Module, device: str, rows: int, role: str,
                     combine=None) -> Precision:
    """`setting`: auto, or a dtype the user set (fp32/float32, bf16/bfloat16), which is kept.
    auto: bf16 when `model` has at least `BF16_MIN_PARAMETERS` parameters and its linear layers at
    `rows` rows (a decode step's batch, or a learner's micro-batch, capped) run at least
    `BF16_MIN_SPEEDUP` times faster in bf16 than in fp32 on `device`, measured now. Logged once
    per call, naming `role`. `combine`: maps the probe's `(fp32_s, bf16_s)` to the figures to
    decide on (the sum over a sharded learner's ranks, so that every rank decides alike)."""
    if setting not in ("auto", "fp32", "float32", "bf16", "bfloat16"):
        raise ValueError(f"precision must be auto, fp32/float32 or bf16/bfloat16, got {setting!r}")
    if setting != "auto":
        chosen = Precision(setting in ("bf16", "bfloat16"), f"set to {setting}")
    elif (parameters := sum(p.numel() for p in model.parameters())) < BF16_MIN_PARAMETERS:
        chosen = Precision(False, f"auto: {parameters / 1e6:.2f}M parameters, under {BF16_MIN_PARAMETERS / 1e6:.0f}M")
    else:
        fp32_s, bf16_s = probe_seconds(linear_shapes(model), rows, device)
        if combine is not None:
            fp32_s, bf16_s = combine(fp32_s, bf16_s)
        speedup = fp32_s / bf16_s
        chosen = Precision(speedup >= BF16_MIN_SPEEDUP,
                           f"auto: bf16 matmuls {speedup:.2f}x fp32's on the model's shapes at {rows} rows "
                           f"(bf16 from {BF16_MIN_SPEEDUP}x), measured on {device_name(device)}",
                           round(fp32_s * 1e3, 3), round(bf16_s * 1e3, 3))
    log.info("%s precision: %s (%s)", role, chosen.name, chosen.reason)
    return chosen


def linear_shapes(model: torch.nn.Module) -> tuple[tuple[int, int, int], ...]:
    """`(in_features, out_features, count)` of the model's linear layers (a tied LM head counted once)."""
    counts: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            key = (module.in_features, module.out_features)
            counts[key] = counts.get(key, 0) + 1
    return tuple(sorted((i, o, n) for (i, o), n in counts.items()))


@functools.lru_cache(maxsize=16)
def probe_seconds(shapes: tuple[tuple[int, int, int], ...], rows: int, device: str) -> tuple[float, float]:
    """Seconds for one pass over `shapes` (each layer once) at `rows` rows, in fp32 and in bf16:
    for each shape the faster of three timings, the dtypes interleaved (another job on the
    machine slows both alike). Kept per process: roles sharing one ask once."""
    totals = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for fan_in, fan_out, count in shapes:
        columns = min(fan_out, PROBE_MAX_COLUMNS)
        calls = {}
        for dtype in totals:
            x = torch.randn(rows, fan_in, dtype=dtype, device=device)
            w = torch.randn(columns, fan_in, dtype=dtype, device=device)
            calls[dtype] = functools.partial(torch.nn.functional.linear, x, w)
            _timed(calls[dtype], device)  # warm-up: oneDNN builds its kernel on the first call
        best = {dtype: min(_timed(calls[dtype], device) for _ in range(3)) for dtype in totals}
        for dtype, seconds in best.items():
            totals[dtype] += seconds * count * fan_out / columns
    return totals[torch.float32], totals[torch.bfloat16]


def _timed(call, device: str) -> float:
    """Seconds per call, looping for at least `PROBE_MIN_SECONDS`."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    n, start = 0, time.perf_counter()
    while n == 0 or time.perf_counter() - start < PROBE_MIN_SECONDS:
        call()
        n += 1
        sync()
    return (time.perf_counter() - start) / n


def device_name(device: str = "cpu") -> str:
    """The processor's model name, as timings are reported beside it: the CPU's (from
    /proc/cpuinfo, else `platform`) or the CUDA device's."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
