"""The house rules of tfjax/ (docs/design.md, "Layout"), read from the source, not run:
files and functions a reader can hold, no import cycle, and the layers' directions: the family
specs import no Flax, and tfjax.nnx stands on ops/ and specs/, not on the Linen modules."""

import ast
import os

import pytest
from conftest import ROOT

PACKAGE = os.path.join(ROOT, "tfjax")
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every module of tfjax/."""
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


MODULES = _modules()


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


SOURCES = {name: _read(path) for name, path in MODULES.items()}
TREES = {name: ast.parse(SOURCES[name], MODULES[name]) for name in MODULES}


def _imports(name: str) -> set[str]:
    """The tfjax modules `name` imports, at its top or inside functions alike (an import
    inside a function still makes a cycle, one that only waits for its first call)."""
    package = name if MODULES[name].endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # a submodule by name, else a name of the module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def test_no_file_is_longer_than_a_reader_holds():
    long = {
        os.path.relpath(MODULES[name], ROOT): n
        for name, source in SOURCES.items()
        if (n := len(source.splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by concern): {long}"


def test_no_function_is_longer_than_a_screenful_or_two():
    long = [
        f"{os.path.relpath(MODULES[name], ROOT)}:{node.lineno} {node.name} "
        f"({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_cycle():
    graph = {name: _imports(name) for name in MODULES}
    cycles, done = [], set()

    def visit(name, path):
        if name in path:
            cycles.append(path[path.index(name) :] + [name])
            return
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def _importers(prefix: str, imported: tuple[str, ...]) -> list[str]:
    """The modules under `prefix` that import a module under any of `imported`."""
    return sorted(
        f"{name} imports {other}"
        for name in MODULES
        if name == prefix or name.startswith(prefix + ".")
        for other in _imports(name) | _third_party(name)
        if any(other == i or other.startswith(i + ".") for i in imported)
    )


def _third_party(name: str) -> set[str]:
    """The top-level names of what `name` imports from outside tfjax (flax, jax, ...)."""
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return {m for m in found if not m.startswith("tfjax")}


@pytest.mark.parametrize(
    "layer, forbidden, why",
    [
        ("tfjax.specs", ("flax",), "a family's fields and checks hold for Linen and NNX alike"),
        ("tfjax.ops", ("tfjax.nn", "tfjax.nnx", "tfjax.models"), "the maths both stand on"),
        ("tfjax.nnx", ("tfjax.nn", "tfjax.models"), "NNX is built from specs/ and ops/"),
    ],
)
def test_layers_import_only_what_is_below_them(layer, forbidden, why):
    assert not _importers(layer, forbidden), f"{layer}: {why}; but {_importers(layer, forbidden)}"
