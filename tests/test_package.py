"""The package's structure: every module imports on its own, no import cycle, layers point down,
production code never imports the test support (``mbridge_refit.testing``).

The import graph is read from the source (AST), counting imports inside functions and under
``TYPE_CHECKING`` too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mbridge_refit"

# Lowest first. A module may import modules of its own layer or of lower layers only.
LAYERS = (
    ("errors", "lazy_exports"),
    ("plan",),
    ("runtime",),
    ("fp8",),
    ("checkpoints",),
    ("sinks",),
    ("engines",),
    ("bridge",),
    ("models",),
    ("convert", "cli"),
    ("testing",),
)


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages by their __init__)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        dotted = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        modules[dotted.removesuffix(".__init__")] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (a package's __init__ re-exporting its own
    children is not counted as depending on them)."""
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _import_targets(node, name, is_package):
                resolved = _resolve(target, modules)
                if resolved and resolved != name and not (is_package and resolved.startswith(name + ".")):
                    graph[name].add(resolved)
    return graph


def _import_targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


# Packages of one layer that never import each other, in either direction: the refit paths stand
# side by side on what is shared below them (engines.base, engines.worker_call, engines.replay).
SEPARATE = (("mbridge_refit.engines.ipc", "mbridge_refit.engines.broadcast"),)


def crossings(graph: dict[str, set[str]], separate=SEPARATE) -> list[str]:
    """``"module imports target"`` for every import from one package of a ``separate`` pair into the other."""

    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        for a, b in separate
        for here, there in ((a, b), (b, a))
        if inside(module, here) and inside(target, there)
    )


def layer_of_module(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module} belongs to no layer: add its top-level name to LAYERS in {__file__}")


MODULES = package_modules()


# A server that imports the heavy third-party packages once, then imports each module it is sent
# in a forked child of its own: every child starts with no mbridge_refit module loaded, as a fresh
# interpreter would, without paying torch's and Megatron's import time ~90 times.
_IMPORT_SERVER = """
import os, sys, traceback
replies = os.fdopen(os.dup(1), 'w')  # the protocol's channel; anything printed goes to stderr
os.dup2(2, 1)
import torch, transformers, safetensors, megatron.core, megatron.bridge  # noqa: F401  (third party only)
assert not [m for m in sys.modules if m.split('.')[0] == 'mbridge_refit']
replies.write('ready\\n'); replies.flush()
for line in sys.stdin:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(line.strip())
            message = b'ok'
        except BaseException:
            message = traceback.format_exc()[-3000:].encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    reply = b''.join(chunks).decode() or 'the child died without a word'
    replies.write(repr(reply) + '\\n'); replies.flush()
"""


@pytest.fixture(scope="module")
def import_server():
    proc = subprocess.Popen(
        [sys.executable, "-c", _IMPORT_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=PACKAGE.parent,
    )
    assert proc.stdout.readline().strip() == "ready", "the import server did not start"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith(".__main__")))  # __main__ runs on import
def test_module_imports_alone(module, import_server):
    """Each module imports with no other module of the package loaded before it (no hidden order
    dependency, no cycle at import): a forked child of a process that holds only third-party imports."""
    import ast as _ast

    import_server.stdin.write(module + "\n")
    import_server.stdin.flush()
    reply = _ast.literal_eval(import_server.stdout.readline())
    assert reply == "ok", reply


def test_import_server_reports_a_failing_import(import_server):
    """Control: a module that fails to import is reported with its traceback."""
    import ast as _ast

    import_server.stdin.write("mbridge_refit.no_such_module\n")
    import_server.stdin.flush()
    reply = _ast.literal_eval(import_server.stdout.readline())
    assert "ModuleNotFoundError" in reply and "no_such_module" in reply


def test_no_import_cycle():
    cycle = find_cycle(import_graph(MODULES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lower_layers_never_import_higher_ones():
    graph = import_graph(MODULES)
    upward = [
        f"{module} (layer {layer_of_module(module)}) imports {target} (layer {layer_of_module(target)})"
        for module, targets in graph.items()
        if module != "mbridge_refit"
        for target in targets
        if target != "mbridge_refit" and layer_of_module(target) > layer_of_module(module)
    ]
    assert not upward, "\n".join(upward)


def test_ipc_and_broadcast_never_import_each_other():
    found = crossings(import_graph(MODULES))
    assert not found, "refit paths import each other (share through engines.base or engines.replay):\n" + "\n".join(
        found
    )


def test_crossing_check_names_the_importer(tmp_path):
    """Control: an import from one package of a separate pair into the other, lazy or eager, either
    way, is caught by name; both importing a shared module is fine."""
    package = tmp_path / "pkg"
    for sub in ("a", "b", "common"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "common" / "shared.py").write_text("")
    (package / "a" / "one.py").write_text("from pkg.common import shared\ndef f():\n    from pkg.b import two\n")
    (package / "b" / "two.py").write_text("import pkg.common.shared\n")
    (package / "b" / "three.py").write_text("import pkg.a\n")
    graph = import_graph(package_modules(package))
    assert crossings(graph, (("pkg.a", "pkg.b"),)) == [
        "pkg.a.one imports pkg.b",
        "pkg.a.one imports pkg.b.two",
        "pkg.b.three imports pkg.a",
    ]


def test_cycle_finder_finds_a_cycle(tmp_path):
    """Control: the check fails when a cycle is introduced (a package whose modules import each other)."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    cycle = find_cycle(import_graph(package_modules(package)))
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.sub.b"}


def support_importers(modules: dict[str, Path], support: str) -> list[str]:
    """``"module imports target"`` for every module outside ``support`` whose source names it: an
    import statement (in a function or under ``TYPE_CHECKING`` too) or a string constant naming a
    module of it (a lazy ``importlib`` table such as the package's ``_PUBLIC``)."""

    def names_support(target: str) -> bool:
        return target == support or target.startswith(support + ".")

    found = []
    for name, path in sorted(modules.items()):
        if names_support(name):
            continue
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = _import_targets(node, name, is_package)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                targets = [node.value]
            found += [f"{name} imports {target}" for target in targets if names_support(target)]
    return sorted(set(found))


def test_production_code_never_imports_the_test_support():
    """The shipped package stands without ``mbridge_refit.testing`` (which the wheel leaves out):
    no module outside it imports it, eagerly or lazily."""
    importers = support_importers(MODULES, "mbridge_refit.testing")
    assert not importers, "production modules import the test support:\n" + "\n".join(importers)


def test_support_check_names_the_importer(tmp_path):
    """Control: a production module importing the test support lazily, or naming it in a lazy
    import table, is caught by name; the test support importing production code is fine."""
    package = tmp_path / "pkg"
    (package / "testing").mkdir(parents=True)
    (package / "__init__.py").write_text('_PUBLIC = {"helper": "pkg.testing.helpers"}\n')
    (package / "testing" / "__init__.py").write_text("")
    (package / "testing" / "helpers.py").write_text("from pkg import core\n")
    (package / "core.py").write_text("def f():\n    from .testing import helpers\n")
    (package / "clean.py").write_text("import pkg.core\n")
    importers = support_importers(package_modules(package), "pkg.testing")
    assert importers == [
        "pkg imports pkg.testing.helpers",
        "pkg.core imports pkg.testing",
        "pkg.core imports pkg.testing.helpers",
    ]


def test_every_error_class_has_the_package_root():
    """Every exception class the package defines derives from ``errors.RefitError``, so callers
    catch by kind and the command line maps kinds (``InputError``: exit 2) without a list of classes."""
    import importlib
    import inspect

    from mbridge_refit.errors import RefitError

    strays = []
    for module in sorted(m for m in MODULES if not m.endswith(".__main__")):
        for name, value in vars(importlib.import_module(module)).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module:
                if not issubclass(value, RefitError):
                    strays.append(f"{module}.{name}")
    assert not strays, f"exception classes outside the hierarchy of mbridge_refit.errors: {strays}"


def _defines_something(tree: ast.Module) -> bool:
    """Whether a module has more than a docstring and imports (a package ``__init__`` with only its
    docstring has no names to declare)."""
    return any(not isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr)) for node in tree.body)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith(".__main__")))
def test_every_module_declares_its_public_names(module):
    """``__all__`` in every module that defines names, listing only names the module has: what a
    reader may use from it is written down, the rest is the module's own."""
    relative = module.split(".")[1:]
    path = PACKAGE.joinpath(*relative).with_suffix(".py")
    if not path.exists():
        path = PACKAGE.joinpath(*relative, "__init__.py")
    tree = ast.parse(path.read_text())
    declared = [
        node
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Name) and t.id == "__all__"
            for t in getattr(node, "targets", [getattr(node, "target", None)])
        )
    ]
    if not _defines_something(tree):
        return
    assert declared, f"{path}: no __all__; list the names other modules and users may import"
    try:
        names = ast.literal_eval(declared[0].value)
    except ValueError:  # computed (a lazy package __init__): every name must resolve
        import importlib

        loaded = importlib.import_module(module)
        unresolved = [name for name in loaded.__all__ if not hasattr(loaded, name)]
        assert not unresolved, f"{module}.__all__ names what it cannot give: {unresolved}"
        return
    bound = (
        {getattr(node, "name", None) for node in tree.body}
        | {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            if isinstance(t, ast.Name)
        }
        | {
            node.target.id
            for node in tree.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        }
        | {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
    )
    missing = sorted(set(names) - bound)
    assert not missing, f"{path}: __all__ names what the module does not define: {missing}"
