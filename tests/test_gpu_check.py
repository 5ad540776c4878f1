"""`load_tests/gpu_check.py` runs as it will on a lent GPU machine: there only the image's packages
(torch, transformers, safetensors, numpy, pyarrow and what they require) and the wheels of
`make gpu-wheels` can be imported, Ray among the rest cannot. Here it runs on the CPU with the tiny
model's shapes, in a subprocess where everything else is hidden from the import system."""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "load_tests"))

import gpu_wheels  # noqa: E402

# The device's interpreter (docs/gpu.md), for the requirements' markers.
DEVICE_PYTHON = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.3"}

SITECUSTOMIZE = '''\
import sys

HIDDEN = frozenset({hidden!r})


class ImageOnly:
    """A finder that finds nothing of HIDDEN: `import ray` fails as on the bare image, and
    `importlib.util.find_spec("ray")` is None there, as optional imports expect."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [ImageOnly(finder) for finder in sys.meta_path]
'''


def image_distributions() -> set[str]:
    """The image's packages and everything they require (no extras; markers as on CPython 3.12),
    the wheels `make gpu-wheels` brings (not what they require: the image must hold that), and
    asyncrl (the working tree)."""
    seen: set[str] = set()
    todo = list(gpu_wheels.IMAGE)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:  # not installed here: nothing of it can be imported
            continue
        todo += [r.name for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate(DEVICE_PYTHON)]
    return seen | {canonicalize_name(n) for n in gpu_wheels.DOWNLOADED + gpu_wheels.BUILT} | {"asyncrl"}


@pytest.fixture(scope="module")
def image_env(tmp_path_factory):
    """Environment variables under which a Python process sees only the image and `.whl/`."""
    allowed = image_distributions()
    hidden = sorted(top for top, dists in importlib.metadata.packages_distributions().items()
                    if not any(canonicalize_name(d) in allowed for d in dists))
    site = tmp_path_factory.mktemp("image-only")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(hidden=hidden))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), ROOT]), "PYTHONUNBUFFERED": "1"}
    return env, hidden


def test_the_image_hides_ray_and_keeps_the_wheels(image_env):
    env, hidden = image_env
    assert {"ray", "wandb"} <= set(hidden)
    assert not {"torch", "transformers", "msgspec", "omegaconf", "hydra", "antlr4", "yaml"} & set(hidden)
    probe = ("import importlib.util\n"
             "assert importlib.util.find_spec('ray') is None\n"
             "try:\n    import ray\nexcept ModuleNotFoundError:\n    print('no ray')\n"
             "import msgspec, omegaconf, hydra\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["no", "ray", "ok"]


def test_gpu_check_prints_its_table_without_ray_on_cpu(image_env, tmp_path):
    env, _ = image_env
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "load_tests/gpu_check.py", "--tiny", "--quick", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    table = [line for line in lines if line.startswith("| ")]
    checks = [row.split(" | ")[0].removeprefix("| ") for row in table[1:]]
    assert checks == ([f"engine tokens/s, batch {b}, float32" for b in (1, 16, 64, 256)]
                      + ["learner step fp32, fused AdamW", "learner step bf16 autocast, fused AdamW",
                         "AdamW step alone, fused", "weight update shm, 2 processes",
                         "log-probs engine vs learner, bf16 (engine bf16 weights, learner bf16 autocast)",
                         "log-probs engine vs learner, fp32", "FSDP2 step, world size 1, fp32", "wall time"])
    assert "on CPU: the shared-memory path (shm), not CUDA IPC" in done.stdout
    assert lines[0].startswith("GPU check on CPU:") and "the tiny model's shapes" in lines[0]
    result = json.loads(out.read_text())
    assert result["failed"] == [] and result["device"] == "cpu"
    figures = result["figures"]
    assert all(f["engine_tokens_per_s"] > 0 and f["generate_tokens_per_s"] > 0 for f in figures["engine"].values())
    # The same weights and tokens: fp32 agrees to rounding, bf16 within bf16's precision of a log-prob.
    assert figures["logprobs"]["fp32"]["max"] < 1e-4 and figures["logprobs"]["fp32"]["tokens"] > 0
    assert figures["logprobs"]["bf16"]["max"] < 0.5
    assert figures["weight_update"]["path"] == "shm" and figures["weight_update"]["update_s"] > 0
    assert figures["fsdp2"]["grad_norm_relative_gap"] < 1e-4 and figures["fsdp2"]["weights_max_gap"] < 1e-6


def test_embedded_shapes_are_the_embedded_models(embedded_policy):
    """The check's random model has the embedded model's architecture (the GGUF file's config)."""
    from gpu_check import EMBEDDED_SHAPES

    config = embedded_policy[0].config
    for key, value in EMBEDDED_SHAPES.items():
        assert getattr(config, key) == pytest.approx(value), key
