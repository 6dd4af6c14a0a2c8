"""The house's import rules (DESIGN.md, rules 1 and 6), read from the source: every import
statement counts, including those inside functions (a lazy import is still a dependency).

- workflow -> stages -> optimus_core -> optimus_kernels (kernels/), never back; the core imports no
  orchestrator or plotting library; the kernels import only torch, triton and the standard library.
- Inside the core: base modules (configs, planning, storage) <- data, model <- parallel <- train
  <- the core's entry points; no module imports a later layer, and there is no circle.
"""
import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Each package's import name and the directory holding it (the kernels' source root is kernels/, so
# that nothing at the top of the checkout is importable as ``kernels``: Hugging Face's name).
SOURCE_ROOTS = {"optimus_core": ROOT, "optimus_kernels": ROOT / "kernels", "stages": ROOT, "workflow": ROOT}
PACKAGES = tuple(SOURCE_ROOTS)

# The core's layers, lowest first: a module may import its own layer and those before it.
CORE_LAYERS = [
    {"atomic", "outputs", "paths", "config", "device", "flops", "log", "timing", "provenance", "store", "presets", "tags", "memory",
     "validation", "compile_cache"},
    {"data", "model"},
    {"parallel"},
    {"execution"},  # the plan, applied to the model from outside: above the model and parallel/
    {"train", "hf"},  # hf: a checkpoint format beside train/checkpoint.py's own
    {"eval", "rehearsal", ""},  # "": the package itself (optimus_core.load_model, ...)
]


def module_name(path: Path) -> str:
    root = next(r for p, r in SOURCE_ROOTS.items() if path.is_relative_to(r / p))
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The absolute module names ``path`` imports (``from a import b``: ``a.b`` where that is a
    module of ours, else ``a``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}  # never run: not a dependency
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if _is_module(sub) else target)
    return found


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_module(dotted: str) -> bool:
    path = SOURCE_ROOTS.get(dotted.split(".")[0], ROOT).joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def sources(package: str) -> list[Path]:
    return sorted((SOURCE_ROOTS[package] / package).rglob("*.py"))


GRAPH = {module_name(p): imports(p) for package in PACKAGES for p in sources(package)}


def ours(names) -> set[str]:
    return {n for n in names if n.split(".")[0] in PACKAGES}


def core_layer(module: str) -> int:
    parts = module.split(".")
    assert parts[0] == "optimus_core", module
    unit = parts[1] if len(parts) > 1 else ""
    for rank, layer in enumerate(CORE_LAYERS):
        if unit in layer:
            return rank
    raise AssertionError(f"{module}: not in any layer of CORE_LAYERS; add it where it belongs")


@pytest.mark.parametrize("package, forbidden", [
    ("optimus_kernels", ("optimus_core", "stages", "workflow")),
    ("optimus_core", ("stages", "workflow", "snakemake", "parsl", "matplotlib")),
    ("stages", ("workflow", "snakemake", "parsl")),
])
def test_imports_point_one_way(package, forbidden):
    bad = sorted(f"{m} imports {dep}" for m, deps in GRAPH.items() if m.split(".")[0] == package
                 for dep in deps if dep.split(".")[0] in forbidden)
    assert not bad, "\n".join(bad)


def test_kernels_import_only_torch_triton_and_the_standard_library():
    allowed = {"torch", "triton", "optimus_kernels", "__future__"} | set(sys.stdlib_module_names)
    bad = sorted(f"{m} imports {dep}" for m, deps in GRAPH.items() if m.startswith("optimus_kernels")
                 for dep in deps if dep.split(".")[0] not in allowed)
    assert not bad, "\n".join(bad)


def test_the_core_imports_model_then_parallel_then_train_never_back():
    bad = []
    for module, deps in GRAPH.items():
        if not module.startswith("optimus_core"):
            continue
        for dep in ours(deps):
            if dep.startswith("optimus_core") and core_layer(dep) > core_layer(module):
                bad.append(f"{module} (layer {core_layer(module)}) imports {dep} (layer {core_layer(dep)})")
    assert not bad, "\n".join(sorted(bad))


def test_no_circle_among_our_modules():
    """A package's own __init__ re-exporting its modules is not a circle (each module's import of a
    sibling goes through the package only by name)."""
    edges = defaultdict(set)
    for module, deps in GRAPH.items():
        for dep in ours(deps):
            if dep != module and not module.startswith(dep + "."):  # a module's own package: its parent
                edges[module].add(dep)
    circles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_graph_is_read_from_the_real_files():
    """A check that finds nothing because it reads nothing would pass: the graph holds what we know is there."""
    assert "optimus_core.train.loop" in GRAPH and "optimus_core.model.transformer" in GRAPH
    assert "optimus_core.train.build" in GRAPH["optimus_core.train.loop"]
    assert "optimus_core.parallel.mesh" in GRAPH["optimus_core.parallel.expert_parallel"]  # a relative import
    assert "optimus_kernels._triton" in GRAPH["optimus_kernels.selfcheck"]


def test_the_checkout_leaves_the_import_name_kernels_to_hugging_face(tmp_path):
    """transformers imports Hugging Face's ``kernels`` when it is installed; run from the top of a
    checkout (the working directory first on sys.path), that import must still find theirs, and
    ours stays importable as ``optimus_kernels``."""
    theirs = tmp_path / "site" / "kernels"
    theirs.mkdir(parents=True)
    (theirs / "__init__.py").write_text("def get_kernel(name):\n    return 'hub:' + name\n")
    probe = "import kernels, optimus_kernels; print(kernels.get_kernel('x'), optimus_kernels.grouped_mm.__name__)"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["hub:x", "grouped_mm"]
