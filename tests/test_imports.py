"""The packages' layering: every module imports, the module-level import graph has no cycle, and imports inside
functions are only of optional dependencies (or one of the few named exceptions).

The graph is read from the source (an AST scan): module ``M`` depends on every internal module it imports at
module level (``if TYPE_CHECKING:`` blocks excepted), and on each package ``__init__`` above it that ``M`` is not
inside (importing ``a.b.c`` from outside runs ``a/__init__`` and ``a/b/__init__`` first), which is how Python
runs it: a cycle there is an import that works in one order and fails in another.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("diffspec_jax", "pallas_kernels", "checkpoints_tools")

#: top-level packages a function may import: optional dependencies, or costly ones only some paths need
OPTIONAL = {
    "torch": "the transformers reference and .bin conversion (test extra); the torch bridge imports it at the top",
    "transformers": "tokenizers and the tiny reference models: seconds to import, and only text paths need it",
    "tokenizers": "training a tokenizer (the demo build)",
    "matplotlib": "benchmark figures (test extra)",
    "fastapi": "the server stack (serve extra)", "starlette": "the server stack (serve extra)",
    "uvicorn": "the server stack (serve extra)", "pydantic": "the server stack (serve extra)",
    "prometheus_client": "the server stack (serve extra)",
    "jinja2": "chat templates (serve extra): the server names it when it is missing",
}

#: (importing module or package, imported module prefix) -> why it is imported inside a function
EXCEPTIONS = {
    ("diffspec_jax.validation", "jax"): "`import diffspec_jax` loads validation (through config) and must not "
                                        "import JAX (torch-only processes use diffspec_jax.torch_bridge)",
    ("diffspec_jax.torch_bridge", "jax"): "the bridge runs in torch-only processes; only to_jax needs JAX",
    ("pallas_kernels", "jax.experimental.pallas.triton"): "the Triton lowering: GPUs only",
    ("diffspec_jax.models.attention", "jax._src.cudnn"): "JAX's cuDNN binding: GPUs only",
    ("diffspec_jax.serve", "diffspec_jax.serving.app"): "the FastAPI app needs the serve extra; serve.py reports "
                                                        "its absence as a usage error",
    ("diffspec_jax.serve", "diffspec_jax.serving.limits"): "uvicorn (the serve extra), as serving.app",
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(module-level, function-local)`` imported names of ``module``, each ``(dotted name, line)``; ``from a
    import b`` gives ``a.b`` (a module or a name in ``a``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top, local = [], []

    def names(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        return [f"{base}.{a.name}" if a.name != "*" else base for a in node.names]

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (local if in_function else top).extend((n, child.lineno) for n in names(child))
            elif isinstance(child, ast.If) and not in_function and _is_type_checking(child):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), False)
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return top, local


def _internal(name: str) -> str | None:
    """The internal module an imported dotted name refers to (``a.b.func`` -> ``a.b``), or ``None``."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(module: str) -> set[str]:
    out = set()
    for name, _ in _imports(module)[0]:
        target = _internal(name)
        if target is None or target == module:
            continue
        out.add(target)
        parts = target.split(".")
        for i in range(1, len(parts)):  # the package __init__s Python runs first, unless `module` is inside them
            pkg = ".".join(parts[:i])
            if module != pkg and not module.startswith(pkg + "."):
                out.add(pkg)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_the_scan_sees_what_it_must():
    """The scanner itself: relative imports, ``from pkg import submodule``, package edges, TYPE_CHECKING."""
    assert {"diffspec_jax.models.llama", "diffspec_jax.models.qwen35", "diffspec_jax.cache"} <= _edges(
        "diffspec_jax.models")
    edges = _edges("checkpoints_tools.hf")
    assert {"diffspec_jax.models", "diffspec_jax.models.params", "diffspec_jax"} <= edges  # package __init__s
    assert "diffspec_jax.models" not in _edges("diffspec_jax.models.llama")  # inside its own package
    assert "diffspec_jax.draft" not in _edges("diffspec_jax")  # only under TYPE_CHECKING (and lazily)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = {m: _edges(m) for m in MODULES}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _allowed(module: str, name: str) -> bool:
    if name.split(".")[0] in OPTIONAL:
        return True
    return any((module == who or module.startswith(who + ".")) and (name == what or name.startswith(what + "."))
               for who, what in EXCEPTIONS)


def test_function_local_imports_are_only_of_optional_dependencies():
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {name}" for m in MODULES for name, line in _imports(m)[1]
           if not _allowed(m, name)]
    assert not bad, ("imports inside functions (move them to the top; only optional dependencies or the named "
                     "EXCEPTIONS belong there):\n" + "\n".join(bad))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports(module):
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:  # an optional dependency that is not installed here
        if (exc.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{module} needs {exc.name}")
        raise


def test_package_namespace_is_the_public_api():
    """dir(diffspec_jax) lists the public API, not the helpers __init__ imports (Any, TYPE_CHECKING, importlib...);
    nothing private either."""
    import diffspec_jax

    names = set(dir(diffspec_jax))
    assert set(diffspec_jax.__all__) <= names and "__version__" in names
    helpers = {"Any", "TYPE_CHECKING", "annotations", "importlib", "import_module"}
    assert not names & helpers and not any(hasattr(diffspec_jax, n) for n in helpers)
    assert not [n for n in names if n.startswith("_") and not n.endswith("__")]
    assert diffspec_jax.SpecConfig().num_speculative_tokens >= 1  # an eager name; the lazy ones are in __all__


# ------------------------------------------------------------------------------------- the engine's private names
#: trees whose modules may import only the engine's public names (``diffspec_jax/engine/`` itself excepted)
SCANNED = ("diffspec_jax", "benchmarks", "checkpoints_tools", "tests")
ENGINE = "diffspec_jax.engine"


def _private_engine_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import of a leading-underscore name from an ``diffspec_jax.engine`` module
    in ``source`` (module ``module``), at any depth (function-local imports included)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base == ENGINE or base.startswith(ENGINE + "."):
                out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name.startswith("_")]
                out += [(node.lineno, base)] if any(p.startswith("_") for p in base.split(".")) else []
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith(ENGINE + ".")
                    and any(p.startswith("_") for p in a.name.split("."))]
    return out


def test_the_private_import_scan_sees_what_it_must():
    src = ("from diffspec_jax.engine.driver import generate, _replay\n"
           "from diffspec_jax.engine import _Program\n"
           "def f():\n    from .loop import _block\n"
           "import diffspec_jax.engine._hidden\n"
           "from diffspec_jax.engine import loop, generate\n"
           "from diffspec_jax.models import _private\n")
    top = [(1, "diffspec_jax.engine.driver._replay"), (2, "diffspec_jax.engine._Program"),
           (5, "diffspec_jax.engine._hidden")]
    assert sorted(_private_engine_imports(src, "diffspec_jax.user")) == top  # `.loop` is diffspec_jax.loop there
    assert sorted(_private_engine_imports(src, "diffspec_jax.engine.user")) == sorted(
        top + [(4, "diffspec_jax.engine.loop._block")])


def test_nothing_outside_the_engine_imports_its_private_names():
    """The server, the CLI, tests and benchmarks import only the engine's public names: a helper the engine shares
    with them is public in one home (:mod:`diffspec_jax.engine.rules` for the host-side rules)."""
    bad = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts or rel.parts[:2] == ("diffspec_jax", "engine"):
                continue
            parts = rel.with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found = _private_engine_imports(path.read_text(encoding="utf-8"), module, parts[-1] == "__init__")
            bad += [f"{rel}:{line}: {name}" for line, name in found]
    assert not bad, "private engine names imported outside diffspec_jax/engine/:\n" + "\n".join(bad)


def test_the_engine_package_exports_only_public_names():
    import diffspec_jax.engine as engine

    assert not [n for n in engine.__all__ if n.startswith("_")]
    assert not [n for n in vars(engine) if n.startswith("_") and not n.endswith("__")]
    assert all(hasattr(engine, n) for n in engine.__all__)


# ------------------------------------------------------------------------------------------ function length
#: the longest a library function may be, in lines from its ``def`` to its last line (decorators excluded)
MAX_FUNCTION_LINES = 120


def test_no_library_function_is_longer_than_the_limit():
    long = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} ({n} lines)")
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)
