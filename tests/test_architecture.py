"""The package's floors, checked from the source: no import cycle (between modules, and between
packages), imports only point down, no framework imported outside the backends (and the
benchmarks, which time HF against us), backends reached only through the registry, and no
module outside the backends asking "is this torch?".

Every import statement counts, including those inside functions: an import hidden in a function
is still a dependency, and hiding one is how the old cycles survived. ``from package import name``
is an edge to ``package.name`` where that is a module, else to the package itself (a name its
``__init__`` defines): an edge to an ancestor package is a real dependency, never dropped.
"""

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "hyper_gen")
FRAMEWORKS = ("torch", "mindspore", "torch_npu", "transformers")
BACKEND_NAMES = ("torch", "mindspore")

# floor of each top-level part of the package; a module may import only its own floor or lower.
# The product parts each have a floor of their own, so none can import a part above it.
FLOORS = {
    "core": 0,  # hyper_gen/*.py: config, inputs, masks, sampling, noise, cache, drivers, generation, ...
    "parallel": 0,
    "demo": 0,
    "engine": 0,  # in-flight batching: slots, per-request sampling, the async request API
    "kv_cache": 0,  # paged KV bookkeeping: block ids, refcounts, hashes, snapshot slots (no framework)
    "models": 1,  # family descriptions, checkpoint reader, load_model (reaches kernels via the registry)
    "backends": 2,  # ops + kernels consume core and the model descriptions
    "facade": 3,  # hyper_gen/__init__: the public names (core's, and load_model)
    "jobs": 4,  # what every product part shares: user errors, the tokenizer, the resumable JSONL runner
    "server": 5,  # the OpenAI-compatible HTTP server (FastAPI + uvicorn) on the engine
    "bench": 6,  # benchmarks: the jobs and the server (as a process) timed against their anchors
    "cli": 7,  # the hyper-gen command: every product part behind one parser
    "main": 8,  # python -m hyper_gen
}

# parts that are one package in all but folder: parallel/ is the core's own subfolder (generate
# steps through model_group, which finds ops through the registry)
PACKAGE_OF_PART = {"parallel": "core"}


def _part(module: str) -> str:
    if module == "hyper_gen":
        return "facade"
    if module == "hyper_gen.__main__":
        return "main"
    parts = module.split(".")
    return parts[1] if parts[1] in FLOORS else "core"


def _modules():
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
            module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
            found[module] = path
    return found


MODULES = _modules()
TREES = {}
for _module, _path in MODULES.items():
    with open(_path, encoding="utf-8") as _f:
        TREES[_module] = ast.parse(_f.read(), _path)


def _known(name: str) -> str:
    """The longest prefix of ``name`` that is a hyper_gen module ('' if none)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> set:
    """hyper_gen modules and top-level frameworks that ``module`` imports, anywhere in the file."""
    is_package = MODULES[module].endswith("__init__.py")
    targets = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            # a submodule is an edge to it; any other name is one to the package that defines it
            names = [
                f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name.split(".")[0] in FRAMEWORKS:
                targets.add(name.split(".")[0])
            found = _known(name)
            if found.startswith("hyper_gen") and found != module:
                targets.add(found)
    return targets


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(graph) -> list:
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_cycles():
    graph = {m: {t for t in ts if t in MODULES} for m, ts in GRAPH.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _package(module: str) -> str:
    part = _part(module)
    return PACKAGE_OF_PART.get(part, part)


def test_no_package_cycles():
    """The parts as nodes (cli, bench, server, jobs, models, ...): a cycle between two packages is
    one even when no two modules close it."""
    graph, why = {}, {}
    for module, targets in GRAPH.items():
        for target in targets:
            if target in MODULES and _package(target) != _package(module):
                graph.setdefault(_package(module), set()).add(_package(target))
                why.setdefault((_package(module), _package(target)), f"{module} -> {target}")
    cycles = _cycles(graph)
    lines = [" -> ".join(c) + "  (" + "; ".join(why[a, b] for a, b in zip(c, c[1:])) + ")" for c in cycles]
    assert not cycles, "package cycles:\n" + "\n".join(lines)


def test_imports_point_down():
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            if target in MODULES and FLOORS[_part(target)] > FLOORS[_part(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports pointing up a floor:\n" + "\n".join(sorted(upward))


def test_product_parts_are_separate_floors():
    """cli, bench, server and jobs: none shares a floor with another, so none imports one above it."""
    product = ("jobs", "server", "bench", "cli")
    assert len({FLOORS[p] for p in product}) == len(product)
    assert min(FLOORS[p] for p in product) > FLOORS["facade"]


@pytest.mark.parametrize("part", ["core", "parallel", "models", "facade", "jobs", "demo", "engine", "server", "main"])
def test_no_framework_import_outside_the_backends(part):
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _part(module) == part
        for target in targets
        if target in FRAMEWORKS and (module, target) not in ALLOWED_FRAMEWORK_IMPORTS
    )
    assert not offenders, "\n".join(offenders)


def test_bench_imports_only_the_anchor_frameworks():
    """The benchmarks import torch and transformers for their HF anchors; a backend's framework
    otherwise comes through the registry."""
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _part(module) == "bench"
        for target in targets
        if target in FRAMEWORKS and target not in ("torch", "transformers")
    )
    assert not offenders, "\n".join(offenders)


# HF models are driven through transformers' own cache, and the product loads the HF tokenizer:
# both only run when the user already handed us an HF object or asked for a tokenizer.
ALLOWED_FRAMEWORK_IMPORTS = {
    ("hyper_gen.drivers", "transformers"),
    ("hyper_gen.jobs.tokenizer", "transformers"),
}


def _outside_the_backends(module: str) -> bool:
    return module != "hyper_gen.registry" and _part(module) != "backends"


def test_backends_are_reached_through_the_registry():
    """Outside the adapters, no module imports a backend package (the registry imports them by name)."""
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _outside_the_backends(module)
        for target in targets
        if target.startswith("hyper_gen.backends")
    )
    assert not offenders, "\n".join(offenders)


def _string_constants(node) -> list:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _string_constants(element)]
    return []


def test_no_backend_name_compared_outside_the_backends():
    """``backend == "mindspore"`` (or ``in ("torch", ...)``) outside the adapters and the registry is a
    capability question asked by name: ask the adapter for the capability instead."""
    offenders = []
    for module, tree in TREES.items():
        if not _outside_the_backends(module):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                for operand in [node.left, *node.comparators]:
                    for value in _string_constants(operand):
                        if value in BACKEND_NAMES:
                            offenders.append(f"{module}:{node.lineno}: compares with {value!r}")
    assert not offenders, "\n".join(offenders)


def test_backend_packages_named_in_the_registry_only():
    """No module outside the registry and the adapters spells out a backend's package (importlib)."""
    offenders = []
    for module, tree in TREES.items():
        if not _outside_the_backends(module):
            continue
        for node in ast.walk(tree):
            for value in _string_constants(node):
                if value.startswith("hyper_gen.backends."):
                    offenders.append(f"{module}:{node.lineno}: {value!r}")
    assert not offenders, "\n".join(offenders)


def test_the_checks_see_a_violation():
    """The walkers above find what they look for (a cycle, a backend import, a name comparison)."""
    tree = ast.parse('from hyper_gen.backends.torch import ops\nif backend == "torch": pass\n')
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert _string_constants(compares[0].comparators[0]) == ["torch"]
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert _known("hyper_gen.backends.torch.ops.TorchOps") == "hyper_gen.backends.torch.ops"


@pytest.mark.parametrize("module", ["hyper_gen", "hyper_gen.cli", "hyper_gen.models.loading", "hyper_gen.bench"])
def test_importing_the_package_imports_no_framework(module):
    """A backend is imported when one is chosen (a model handed in, --backend), never before."""
    code = f"import sys, {module}; print(sorted(set(sys.modules) & {set(FRAMEWORKS)!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
