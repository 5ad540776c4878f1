"""The shape of the code (docs/architecture.md, "Layers"): lower layers never import higher ones
(definitions, then plumbing, then the domain, the roles, the run, the entry points), no import
cycles, the pure layers import nothing they should not (`algo` nothing of asyncrl, `config` nothing
that imports torch, `rewards` no `environments`), the roles in `actors/` (importing the library,
never each other), one mapping per choice by name (advantage type, reward kind, environment,
tool format) matching the names the config allows, modules and functions of a readable size, and
a docstring for every config field. Read from the source with `ast`."""

import ast
import os
import subprocess
import sys
import typing
from pathlib import Path

from asyncrl.algo.advantages import ADVANTAGES
from asyncrl.assembly.strategies import STRATEGIES
from asyncrl.config import Config, EnvironmentConfig, schema
from asyncrl.config.algorithm import Advantage
from asyncrl.config.reward import Endpoint

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("asyncrl", "actors")

# Layer of each module (prefix match, longest first). A module may import its own layer or lower.
LAYERS = {
    # Definitions: the typed config, the messages, the pure algorithms.
    0: ["asyncrl.config", "asyncrl.messages", "asyncrl.algo", "asyncrl.errors", "asyncrl.redaction"],
    # Plumbing: moving and keeping things, blind to what they mean.
    1: ["asyncrl.messages.mailbox", "asyncrl.messages.ray_mailbox", "asyncrl.storage", "asyncrl.weights",
        "asyncrl.metrics", "asyncrl.plots", "asyncrl.staleness"],
    # The domain: models and engines, data, rewards, environments, assembly, learning, the OpenAI surface.
    2: ["asyncrl.engines", "asyncrl.models", "asyncrl.data", "asyncrl.rewards", "asyncrl.assembly",
        "asyncrl.learning", "asyncrl.api", "asyncrl.environments", "asyncrl.user_code", "asyncrl.weights.lora"],
    3: ["actors", "asyncrl.data.pre_ppo", "asyncrl.evaluation"],
    4: ["asyncrl.run"],
    5: ["asyncrl.driver", "asyncrl.serve", "asyncrl.cli", "asyncrl.bench", "asyncrl.offline", "asyncrl.config.help"],
}
# Imports a package of the project may never make (a prefix of the imported module's name).
FORBIDDEN = {"asyncrl.algo": ["asyncrl", "actors"], "asyncrl.config": ["asyncrl.algo", "asyncrl.learning"],
             "asyncrl.rewards": ["asyncrl.environments"]}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best = max(((len(prefix), layer) for layer, prefixes in LAYERS.items() for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} has no layer in tests/test_structure.py::LAYERS"
    return best[1]


def imports(path: Path, top_level_only: bool) -> set[str]:
    """Project modules imported by a file (every import, or only those run at import time)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            found.add(node.module)
            for alias in node.names:  # `from asyncrl import checkpoint` imports a module
                base = ROOT / node.module.replace(".", os.sep)
                if (base / f"{alias.name}.py").exists() or (base / alias.name / "__init__.py").exists():
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
    return found


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def test_lower_layers_never_import_higher_ones():
    violations = []
    for module, path in all_modules().items():
        if module in PACKAGES:
            continue
        for target in imports(path, top_level_only=False):
            if target not in PACKAGES and layer_of(target) > layer_of(module):
                violations.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})")
    assert not violations, "\n".join(violations)


def test_pure_layers_import_nothing_they_should_not():
    violations = []
    for module, path in all_modules().items():
        for package, forbidden in FORBIDDEN.items():
            if module == package or module.startswith(package + "."):
                for target in imports(path, top_level_only=False):
                    if any(target == f or target.startswith(f + ".") for f in forbidden) and \
                            not target.startswith(package):
                        violations.append(f"{module} imports {target}")
    assert not violations, "\n".join(violations)


def test_checking_a_config_imports_no_torch():
    """Composing and validating every section (the CLI's --help and --cfg, a Serve app's start-up)
    loads no torch: the config is definitions only."""
    code = ("import sys; from asyncrl.config import compose; "
            "compose(['algorithm=vapo', 'model=tiny', 'task=tiny']); compose(['reward=hybrid']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_no_import_cycles():
    modules = all_modules()
    graph = {m: {t for t in imports(p, top_level_only=False) if t in modules and t != m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [node, nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_roles_live_in_actors_and_never_import_each_other():
    import actors  # installed beside asyncrl

    roles = {p.stem for p in (ROOT / "actors").glob("*.py")}
    assert {"generator", "assembler", "prompt_source", "policy_learner", "value_learner", "recorder",
            "reward_endpoint"} <= roles and actors.__doc__
    assert not (ROOT / "asyncrl" / "roles").exists()
    for module, path in all_modules().items():
        if module.startswith("actors.") and module != "actors.base":
            sideways = {t for t in imports(path, top_level_only=False) if t.startswith("actors") and t != "actors.base"}
            assert not sideways, f"{module} imports {sideways}: roles reach each other through the run's wiring"
    assert '"actors",' in (ROOT / "pyproject.toml").read_text()  # shipped in the wheel (test_packaging checks the list)


def test_a_run_is_reached_through_run_alone():
    """`Run` is the door (issue 56): the incarnation it keeps (`System`, `asyncrl.run.wiring`) is
    imported nowhere outside `asyncrl/run/`, and nothing there reaches a run's `_system`: offline
    generation, the CLI, Serve, the tests and the load tests go through `Run`'s methods."""
    inside = ROOT / "asyncrl" / "run"
    violations = []
    for path in sorted(p for d in (*PACKAGES, "tests", "load_tests") for p in (ROOT / d).rglob("*.py")):
        if inside in path.parents:
            continue
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asyncrl.run"):
                names = {alias.name for alias in node.names}
                if node.module == "asyncrl.run.wiring" or names & {"wiring", "System"}:
                    violations.append(f"{where}:{node.lineno} imports {sorted(names)} from {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("asyncrl.run.wiring") for a in node.names):
                violations.append(f"{where}:{node.lineno} imports asyncrl.run.wiring")
            elif isinstance(node, ast.Attribute) and node.attr == "_system":
                violations.append(f"{where}:{node.lineno} reaches a run's _system")
    assert not violations, "\n".join(violations)


def test_one_mapping_per_choice_by_name_and_the_config_allows_exactly_its_names():
    from asyncrl.environments.formats import FORMATS
    from asyncrl.environments.tools import ENVIRONMENTS
    from asyncrl.rewards.endpoint import SCORERS

    assert set(ADVANTAGES) == set(schema.variants(Advantage)) >= {"grpo", "drgrpo", "rloo", "reinforce_plus_plus",
                                                                    "pairwise", "gae"}
    assert {advantage.kind for advantage in ADVANTAGES.values()} <= set(STRATEGIES)
    assert [name for name, a in ADVANTAGES.items() if STRATEGIES[a.kind].needs_value_learner] == ["gae"]
    assert set(SCORERS) == set(schema.variants(Endpoint))
    hints = typing.get_type_hints(EnvironmentConfig)
    assert set(typing.get_args(hints["name"])) == {"", *ENVIRONMENTS}
    assert set(typing.get_args(hints["tool_format"])) == set(FORMATS)


def test_modules_and_functions_stay_readable():
    too_long = []
    for module, path in all_modules().items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{module}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


def test_every_config_field_has_a_docstring():
    """A field is followed by a string (its docstring) in its section's source, as `--help` reads it."""
    from asyncrl.config.help import field_docs

    missing = sorted({f"{leaf.owner.__name__}.{leaf.name}" for leaf in schema.leaves(Config)
                      if not field_docs(leaf.owner).get(leaf.name)})
    assert not missing, "fields without a docstring: " + ", ".join(missing)


def test_no_two_classes_share_a_name():
    """One concept, one name: a class name is defined once across the package (a second `Advantage`
    or `Verdict` elsewhere is a second meaning of one word)."""
    where: dict[str, list[str]] = {}
    for module, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module)
    shared = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not shared, shared


def test_each_advantage_variants_fields_are_what_its_estimator_or_strategy_reads():
    """A group or batch estimator gets its variant's fields as keyword arguments (bound when the
    strategy is built: a field its function lacks fails at start-up); the value and pairwise
    strategies read each field of theirs by name."""
    import inspect

    import msgspec

    source = "".join((ROOT / "asyncrl" / "assembly" / name).read_text() for name in ("values.py", "rows.py",
                                                                                      "strategies.py", "groups.py"))
    for tag, variant in schema.variants(Advantage).items():
        fields = [f.name for f in msgspec.structs.fields(variant)]
        estimator = ADVANTAGES[tag]
        if estimator.kind in ("group", "batch"):
            assert set(fields) <= set(inspect.signature(estimator.fn).parameters), (tag, fields)
        else:
            unread = [f for f in fields if f".{f}" not in source]
            assert not unread, f"{tag}: fields no strategy reads: {unread}"
