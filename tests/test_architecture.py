"""The package's floors, checked from the source: no import cycle, imports only point down, and
no framework is imported outside the backends (and the benchmarks, which time HF against us).

Every import statement counts, including those inside functions: an import hidden in a function
is still a dependency, and hiding one is how the old cycles survived.
"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "hyper_gen")
FRAMEWORKS = ("torch", "mindspore", "torch_npu", "transformers")

# floor of each top-level part of the package; a module may import only its own floor or lower
FLOORS = {
    "core": 0,  # hyper_gen/*.py: config, inputs, masks, sampling, noise, cache, drivers, generation, ...
    "parallel": 0,
    "demo": 0,
    "engine": 0,  # in-flight batching: slots, per-request sampling, the async request API
    "models": 1,  # family descriptions, checkpoint reader, load_model (reaches kernels via the registry)
    "backends": 2,  # ops + kernels consume core and the model descriptions
    "cli": 3,
    "server": 3,  # the OpenAI-compatible HTTP server (FastAPI + uvicorn) on the engine
    "bench": 3,
    "facade": 4,
}


def _part(module: str) -> str:
    if module in ("hyper_gen", "hyper_gen.__main__"):
        return "facade"  # the public names and ``python -m hyper_gen``: above every floor
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


def _imports(module: str, path: str, known) -> set:
    """hyper_gen modules and top-level frameworks that ``module`` imports, anywhere in the file."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    targets = set()
    for node in ast.walk(tree):
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
            names = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in FRAMEWORKS:
                targets.add(name.split(".")[0])
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("hyper_gen") and name != module:
                targets.add(name)
    return targets


MODULES = _modules()
GRAPH = {m: _imports(m, p, MODULES) for m, p in MODULES.items()}


def _is_ancestor(package: str, module: str) -> bool:
    """Importing a submodule runs its packages' __init__: that edge is structure, not a dependency."""
    return module.startswith(package + ".")


def test_no_import_cycles():
    graph = {m: {t for t in ts if t in MODULES and not _is_ancestor(t, m)} for m, ts in GRAPH.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_point_down():
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            if target not in MODULES or _is_ancestor(target, module):
                continue
            if FLOORS[_part(target)] > FLOORS[_part(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports pointing up a floor:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("part", ["core", "parallel", "models", "cli", "demo", "engine", "server"])
def test_no_framework_import_outside_the_backends(part):
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _part(module) == part
        for target in targets
        if target in FRAMEWORKS and (module, target) not in ALLOWED_FRAMEWORK_IMPORTS
    )
    assert not offenders, "\n".join(offenders)


# HF models are driven through transformers' own cache, and the CLI loads the HF tokenizer:
# both only run when the user already handed us an HF object or asked for a tokenizer.
ALLOWED_FRAMEWORK_IMPORTS = {
    ("hyper_gen.drivers", "transformers"),
    ("hyper_gen.cli.common", "transformers"),
}


def test_backend_names_live_in_the_registry_only():
    """No module outside the registry and the adapters spells out a backend's package."""
    offenders = []
    for module, path in MODULES.items():
        if module == "hyper_gen.registry" or _part(module) == "backends":
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for needle in ('"hyper_gen.backends.torch', '"hyper_gen.backends.mindspore', 'backend == "torch"'):
            if needle in text:
                offenders.append(f"{module}: {needle}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("module", ["hyper_gen", "hyper_gen.cli", "hyper_gen.models.loading", "hyper_gen.bench"])
def test_importing_the_package_imports_no_framework(module):
    """A backend is imported when one is chosen (a model handed in, --backend), never before."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted(set(sys.modules) & {set(FRAMEWORKS)!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
