"""The shape of the code (docs/architecture.md, "Layers"): lower layers never import higher ones,
no import cycles, the roles in one package, one estimator mapping. Read from the source with `ast`."""

import ast
import os
from pathlib import Path

from asyncrl.config import ESTIMATORS as ESTIMATOR_NAMES
from asyncrl.roles.estimators import ESTIMATORS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "asyncrl"

# Layer of each module (prefix match, longest first). A module may import its own layer or lower.
LAYERS = {
    0: ["asyncrl.config", "asyncrl.config_help", "asyncrl.schema", "asyncrl.algo", "asyncrl.staleness"],
    1: ["asyncrl.mailbox", "asyncrl.engines", "asyncrl.models", "asyncrl.ledger", "asyncrl.weight_sync",
        "asyncrl.checkpoint", "asyncrl.tasks", "asyncrl.rewards", "asyncrl.assembly", "asyncrl.learning",
        "asyncrl.generation", "asyncrl.metrics", "asyncrl.plots", "asyncrl.openai_api", "asyncrl.store",
        "asyncrl.learning_dqo", "asyncrl.sharding"],
    2: ["asyncrl.roles", "asyncrl.pre_ppo", "asyncrl.evaluation"],
    3: ["asyncrl.system", "asyncrl.supervisor", "asyncrl.monitor"],
    4: ["asyncrl.driver", "asyncrl.serve_app", "asyncrl.cli", "asyncrl.bench", "asyncrl.offline"],
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best = max(((len(prefix), layer) for layer, prefixes in LAYERS.items() for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} has no layer in tests/test_structure.py::LAYERS"
    return best[1]


def imports(path: Path, top_level_only: bool) -> set[str]:
    """asyncrl modules imported by a file (every import, or only those run at import time)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("asyncrl"):
            found.add(node.module)
            for alias in node.names:  # `from asyncrl import checkpoint` imports a module
                if (PACKAGE / node.module.removeprefix("asyncrl").strip(".").replace(".", os.sep) / f"{alias.name}.py").exists():
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("asyncrl")}
    return found


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_lower_layers_never_import_higher_ones():
    violations = []
    for module, path in all_modules().items():
        if module == "asyncrl":
            continue
        for target in imports(path, top_level_only=False):
            if target != "asyncrl" and layer_of(target) > layer_of(module):
                violations.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})")
    assert not violations, "\n".join(violations)


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


def test_roles_live_in_one_package_and_no_generic_top_level_package_is_installed():
    assert not (ROOT / "actors").exists()
    roles = {p.stem for p in (PACKAGE / "roles").glob("*.py")}
    assert {"generator", "assembler", "prompt_source", "policy_learner", "value_learner"} <= roles
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["asyncrl*"]' in pyproject


def test_one_mapping_from_estimator_name_to_strategy():
    assert set(ESTIMATORS) == set(ESTIMATOR_NAMES)
    assert [name for name, kind in ESTIMATORS.items() if kind.needs_value_learner] == ["gae"]
