"""The code's shape: no class in the packages is over 400 lines (one that grows past it does more than one job, and
is split by job, as ``serving/`` is: preparing, answers, logprobs); the engine's modules import one another without a
circle, counting every relative import: at a module's top, in a ``TYPE_CHECKING`` block, inside a function (a circle
means a concept sits in the wrong module)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import batchgen.server.engine as engine_package

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
MAX_CLASS_LINES = 400


def test_no_class_is_over_400_lines() -> None:
    over = []
    for path in sorted(PACKAGES.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    over.append(f"{path.relative_to(PACKAGES)}:{node.lineno} {node.name} ({lines} lines)")
    assert not over, f"classes over {MAX_CLASS_LINES} lines; split them by job: {', '.join(over)}"


ROOT = Path(engine_package.__file__).parent
PACKAGE = "batchgen.server.engine"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def import_graph() -> dict[str, set[str]]:
    """Each engine module -> the engine modules it imports relatively (``from .x import y`` names ``.x.y`` when
    that is a module of its own)."""
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if _is_package(path) else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                child = f"{target}.{alias.name}"
                imported = child if child in modules else target
                if imported in modules and imported != name:
                    graph[name].add(imported)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _short(name: str) -> str:
    return name.removeprefix(PACKAGE + ".")


def test_the_engine_modules_import_without_a_circle() -> None:
    found = cycles(import_graph())
    assert not found, "import circles in engine/: " + "; ".join(
        "{" + ", ".join(map(_short, component)) + "}" for component in found
    )


LAYERS = ("ops", "attention", "sampling", "loading", "features", "runner", "core", "distributed")
"""The engine's subpackages, lowest first: each imports only from those before it (and the root's modules)."""
MAX_ROOT_MODULES = 12


def _layer(name: str) -> str | None:
    """The subpackage a module is in (``None``: the engine's root)."""
    parts = _short(name).split(".")
    return parts[0] if len(parts) > 1 and parts[0] in LAYERS else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` from a layer to one above it, as ``module -> target``."""
    return sorted(
        f"{_short(module)} -> {_short(target)}"
        for module, targets in graph.items()
        for target in targets
        if (here := _layer(module)) is not None
        and (there := _layer(target)) is not None
        and LAYERS.index(there) > LAYERS.index(here)
    )


def test_the_engine_is_laid_out_in_layers_that_import_only_downward() -> None:
    """``ops`` (kernels, fast paths) < ``attention`` < ``sampling`` < ``loading`` < ``features`` (LoRA, state layers,
    images, pooling) < ``runner`` < ``core`` (the step, the scheduler, the block manager) < ``distributed``; the
    root's few modules (the requests, the sequences, the config; the factory and the worker) serve every layer."""
    upward = upward_imports(import_graph())
    assert not upward, "upward imports between the engine's layers: " + "; ".join(upward)
    root = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at engine/'s root: {', '.join(root)}"
    assert {path.name for path in ROOT.iterdir() if path.is_dir() and (path / "__init__.py").exists()} == set(LAYERS)


def test_an_upward_import_is_found_at_any_depth() -> None:
    runner, core, state = (
        f"{PACKAGE}.{name}" for name in ("runner.model_runner", "core.engine", "features.state.slots")
    )
    graph = {runner: {core, state}, core: {runner}, state: {f"{PACKAGE}.sequence"}}
    assert upward_imports(graph) == ["runner.model_runner -> core.engine"]


def test_a_circle_is_found_at_any_depth_of_a_module() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "batchgen.server.engine.core.scheduler" in import_graph()


FEATURE_NAMES = {
    *("lora", "adapters", "adapter_slot", "LoRARequest", "LoRASlots", "AdapterSlots"),
    *("states", "state_slot", "state_source", "state_checkpoints", "state_reuse", "state_marks", "StateSlots"),
    *("multimodal", "mm", "images", "vision", "spans"),
    *("pooled_from_last", "embed", "wants_prompt_logprobs", "prompt_logprobs"),
    *("dsa", "sparse", "grammar", "matcher"),
}
"""What names a step's features (LoRA, state layers, images, pooling, DSA, grammars) in code."""


def feature_names(path: Path) -> list[str]:
    """The features ``path``'s code names: an import from ``features``, or an identifier, argument or string above."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and "features" in node.module.split("."):
            found.append(f"import from {node.module}")
        names = {
            ast.Name: lambda n: n.id,
            ast.Attribute: lambda n: n.attr,
            ast.arg: lambda n: n.arg,
            ast.keyword: lambda n: n.arg,
            ast.alias: lambda n: n.name,
            ast.Constant: lambda n: n.value if isinstance(n.value, str) and n.value.isidentifier() else None,
        }
        for kind, name_of in names.items():
            if isinstance(node, kind) and name_of(node) in FEATURE_NAMES:
                found.append(f"{name_of(node)} (line {getattr(node, 'lineno', '?')})")
    return found


@pytest.mark.parametrize("module", ["core/scheduler.py", "core/block_manager.py"])
def test_the_scheduler_and_the_block_manager_name_no_feature(module: str) -> None:
    """They know what a feature asks of a step by protocols alone: seats a running sequence holds (a LoRA slot), a
    cache group beside the blocks (a hybrid model's state slots), where a prompt's chunk may end and what keys its
    blocks (images), whether its prompt may start from the prefix cache (pooling, prompt logprobs)."""
    named = feature_names(ROOT / module)
    assert not named, f"{module} names features: {', '.join(named)}"


def test_a_feature_named_is_found(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from ..features.lora import X\ndef f(seq):\n    return seq.state_slot, g(lora=1)\n")
    assert feature_names(source) == ["import from features.lora", "state_slot (line 3)", "lora (line 3)"]


def test_the_model_runner_builds_each_feature_in_a_method_of_its_own() -> None:
    """``ModelRunner.__init__`` composes what its helpers build (the caches, the state layers, the vision step, the fast
    paths, the LoRA slots): under 40 lines."""
    from batchgen.server.engine.runner.model_runner import ModelRunner

    source = Path(inspect.getsourcefile(ModelRunner) or "")
    init = next(
        node
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    assert init.end_lineno is not None and init.end_lineno - init.lineno + 1 < 40
