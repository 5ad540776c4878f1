"""The GPU check's packages beyond a bare GPU image, as wheels for that machine (`make gpu-wheels`).

The image (docs/gpu.md): CPython 3.12 on manylinux x86-64 with torch (CUDA), transformers,
safetensors, numpy and pyarrow and what they require; it reaches no package registry. What
`load_tests/gpu_check.py` imports beyond it: asyncrl's config (msgspec, omegaconf), its composition
(hydra-core), and antlr4's runtime, which omegaconf and hydra-core require at the 4.9 series, of
which PyPI has only the source: its wheel (pure Python) is built here. The versions are this
environment's, the ones CI runs. Ray is not among them: its wheel alone (68 MiB) is over what
travels with a command (64 MiB); the check does not need it.

    python load_tests/gpu_wheels.py [DIRECTORY]    # default .whl (git-ignored)
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

IMAGE = ("torch", "transformers", "safetensors", "numpy", "pyarrow")
DOWNLOADED = ("msgspec", "omegaconf", "hydra-core")
BUILT = ("antlr4-python3-runtime",)
LIMIT_BYTES = 60 << 20
# The device's interpreter and platform (manylinux2014 is manylinux_2_17; pip matches each tag exactly).
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
          "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64"]


def pins(names: tuple[str, ...]) -> list[str]:
    return [f"{name}=={importlib.metadata.version(name)}" for name in names]


def main(directory: str = ".whl") -> int:
    target = Path(directory)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(target),
                    *pins(DOWNLOADED)], check=True)
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(target), *pins(BUILT)], check=True)
    wheels = sorted(target.glob("*.whl"))
    if len(wheels) != len(DOWNLOADED) + len(BUILT):
        raise SystemExit(f"expected one wheel for each of {DOWNLOADED + BUILT}, got {[w.name for w in wheels]}")
    built_here = [w.name for w in wheels if w.name.startswith(tuple(n.replace("-", "_") for n in BUILT))]
    if not all(name.endswith("-py3-none-any.whl") for name in built_here):
        raise SystemExit(f"a wheel built here is not pure Python (it would not run on CPython 3.12): {built_here}")
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:6.2f} MiB  in {target}/ (at most {LIMIT_BYTES / 2**20:.0f} MiB)")
    if total > LIMIT_BYTES:
        raise SystemExit(f"{target}/ holds {total / 2**20:.1f} MiB, over {LIMIT_BYTES / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
