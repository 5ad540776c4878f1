"""asyncrl's SGLang adapter against the pinned SGLang release, read as source (SGLang cannot be
installed on a CPU machine: it needs CUDA torch and a 373 MB kernel wheel).

`make setup` downloads the wheel of the `[sglang]` pin without its dependencies into
`.cache/sglang/`. This test reads the adapter's own source (`asyncrl/engines/sglang_engine.py`)
with `ast` to find every SGLang method, request class, field and keyword argument it uses, and
requires each to exist with that name in the wheel's source, imported nothing from it. A renamed
SGLang argument fails here, not on a GPU machine."""

from __future__ import annotations

import ast
import glob
import os
import re
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "asyncrl" / "engines" / "sglang_engine.py"


def pinned_version() -> str:
    match = re.search(r'"sglang\[srt\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml's [sglang] extra must pin sglang[srt]==X.Y.Z"
    return match.group(1)


@pytest.fixture(scope="module")
def sglang_source() -> dict[str, ast.Module]:
    version = pinned_version()
    wheels = glob.glob(str(ROOT / ".cache" / "sglang" / f"sglang-{version}-*.whl"))
    assert wheels, (f"the sglang {version} wheel is missing from .cache/sglang/: `make setup` downloads it "
                    f"(pip download --no-deps sglang=={version})")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return {name: ast.parse(wheel.read(name).decode(), name) for name in wheel.namelist()
                if name.endswith(".py") and name.startswith(SOURCES)}


# Where what the adapter uses lives in 0.5.23 (the engine, the tokenizer manager and its mixins,
# the request structs, sampling parameters, the server-argument namespaces, weight-version spans).
SOURCES = ("sglang/srt/entrypoints/engine.py", "sglang/srt/managers/tokenizer", "sglang/srt/managers/io_struct.py",
           "sglang/srt/sampling/sampling_params.py", "sglang/srt/arg_groups/fields/",
           "sglang/srt/utils/weight_versions.py")


def classes(source: dict[str, ast.Module]) -> dict[str, ast.ClassDef]:
    return {node.name: node for tree in source.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def methods(cls: ast.ClassDef, all_classes: dict[str, ast.ClassDef]) -> dict[str, ast.FunctionDef]:
    """A class's methods, its bases' included (by name, as the source names them)."""
    out = {}
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name in all_classes:
            out.update(methods(all_classes[name], all_classes))
    out.update({n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))})
    return out


def fields(cls: ast.ClassDef, all_classes: dict[str, ast.ClassDef]) -> set[str]:
    """A msgspec/dataclass request's fields: its annotated attributes, its bases' included."""
    out = set()
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in all_classes:
            out |= fields(all_classes[base.id], all_classes)
    return out | {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def parameters(function: ast.FunctionDef) -> set[str]:
    a = function.args
    return {arg.arg for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]}


def adapter_usage() -> dict:
    """What the adapter uses of SGLang, read from its source."""
    tree = ast.parse(ADAPTER.read_text())
    usage = {"engine_kwargs": set(), "engine_methods": set(), "manager_methods": set(), "requests": {},
             "generate_kwargs": set(), "sampling_keys": set(), "meta_keys": set(), "output_keys": set()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            chain = ast.unparse(f.value)
            if chain == "sglang" and f.attr == "Engine":
                usage["engine_kwargs"] |= {k.arg for k in node.keywords}
            elif chain == "self.engine":
                usage["engine_methods"].add(f.attr)
                if f.attr == "async_generate":
                    usage["generate_kwargs"] |= {k.arg for k in node.keywords}
            elif chain in ("manager", "self.engine.tokenizer_manager"):
                usage["manager_methods"].add(f.attr)
            elif chain in ("io", "io_struct", "self.io_struct"):
                usage["requests"].setdefault(f.attr, set()).update(k.arg for k in node.keywords)
        if isinstance(node, ast.FunctionDef) and node.name == "_sampling":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Dict):
                    usage["sampling_keys"] |= {k.value for k in ret.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.value, ast.Name):
            if node.value.id == "meta":
                usage["meta_keys"].add(node.slice.value)
            elif node.value.id == "out":
                usage["output_keys"].add(node.slice.value)
    return usage


def test_the_adapter_uses_something_of_every_kind():
    """The reader of the adapter finds what it calls (a refactor that hid the calls would make the
    contract below vacuous)."""
    usage = adapter_usage()
    assert {"async_generate", "_serialize_tensors_per_rank", "shutdown"} <= usage["engine_methods"]
    assert {"pause_generation", "update_weights_from_tensor", "continue_generation"} <= usage["manager_methods"]
    assert {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "cache_salt"} <= usage["generate_kwargs"]
    assert {"max_new_tokens", "temperature", "top_p", "top_k", "min_new_tokens", "stop_token_ids"} <= usage["sampling_keys"]
    assert set(usage["requests"]) == {"PauseGenerationReqInput", "UpdateWeightsFromTensorReqInput",
                                      "ContinueGenerationReqInput"}
    assert {"output_token_logprobs", "finish_reason", "weight_version"} <= usage["meta_keys"]


def test_every_sglang_name_the_adapter_uses_exists_in_the_pinned_release(sglang_source):
    usage = adapter_usage()
    all_classes = classes(sglang_source)
    engine = methods(all_classes["Engine"], all_classes)
    missing = sorted(m for m in usage["engine_methods"] if m not in engine)
    assert not missing, f"sglang.Engine has no {missing}"
    generate = parameters(engine["async_generate"])
    assert not usage["generate_kwargs"] - generate, f"Engine.async_generate lacks {usage['generate_kwargs'] - generate}"
    # ServerArgs is assembled from the namespaces of `sglang/srt/arg_groups/fields/` (0.5.23).
    server_args = {name for path, tree in sglang_source.items() if path.startswith("sglang/srt/arg_groups/fields/")
                   for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for name in fields(cls, all_classes)}
    assert not usage["engine_kwargs"] - server_args, f"ServerArgs lacks {usage['engine_kwargs'] - server_args}"
    manager = methods(all_classes["TokenizerManager"], all_classes)
    assert not usage["manager_methods"] - set(manager), f"TokenizerManager lacks {usage['manager_methods'] - set(manager)}"
    for request, keywords in usage["requests"].items():
        assert request in all_classes, f"sglang.srt.managers.io_struct has no {request}"
        known = fields(all_classes[request], all_classes)
        assert not keywords - known, f"{request} has no field(s) {keywords - known}"
    sampling = fields(all_classes["SamplingParams"], all_classes)
    assert not usage["sampling_keys"] - sampling, f"SamplingParams has no {usage['sampling_keys'] - sampling}"
    # The output keys the adapter reads are ones SGLang writes (string constants in its source).
    written = {node.value for tree in sglang_source.values() for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not (usage["meta_keys"] | usage["output_keys"]) - written, \
        f"SGLang never writes {(usage['meta_keys'] | usage['output_keys']) - written}"
    # The pause modes the adapter uses are among those the request accepts.
    pause = all_classes["PauseGenerationReqInput"]
    assert "in_place" in ast.unparse(pause) and "retract" in ast.unparse(pause)


def test_a_renamed_argument_would_fail_this_contract(sglang_source):
    """The check can fail: the same reader on an adapter that calls `async_generate` with a name
    SGLang does not have reports it."""
    all_classes = classes(sglang_source)
    generate = parameters(methods(all_classes["Engine"], all_classes)["async_generate"])
    assert "cache_salt" in generate and "return_logprob" in generate
    assert "return_log_probs" not in generate and "kv_salt" not in generate


def test_the_docker_image_and_the_extra_pin_the_same_sglang():
    version = pinned_version()
    assert f"FROM lmsysorg/sglang:v{version}" in (ROOT / "Dockerfile").read_text()
    assert f"SGLANG_VERSION := {version}" in (ROOT / "Makefile").read_text()  # the wheel this test reads
    assert not os.environ.get("ASYNCRL_IMPORTED_SGLANG")  # nothing here imports SGLang
