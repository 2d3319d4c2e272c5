"""The layering of docs/architecture.md holds: imports go down (or sideways), never up; no
import cycles; no imports of another module's ``_private`` names; every module has a layer.

Imports are read from the source (``ast``): at module level, inside functions and under
``TYPE_CHECKING`` alike, so a function-local import cannot hide a wrong direction.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "django_joblock"
DOC = ROOT / "docs" / "architecture.md"


def _layers() -> dict[str, tuple[int, str]]:
    """component -> (layer number, layer name), from the doc's first ``text`` block."""
    text = DOC.read_text()
    block = text[text.index("```text\n") + len("```text\n") :]
    block = block[: block.index("```")]
    found: dict[str, tuple[int, str]] = {}
    for line in block.strip().splitlines():
        match = re.fullmatch(r"(\d+) ([^:]+): (.+)", line.strip())
        assert match, f"docs/architecture.md: bad layer line {line!r}"
        for component in match[3].split():
            assert component not in found, f"{component} is in two layers"
            found[component] = (int(match[1]), match[2])
    return found


def _modules() -> dict[str, Path]:
    """Dotted name (without the package) -> file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _component(module: str) -> str:
    """The part of a module name the layers speak of: its first component."""
    return module.split(".", 1)[0] if module else "__init__"


def _imports(module: str, path: Path) -> list[tuple[str, list[str], bool, int]]:
    """(imported module, names, module level?, line) for each import of the package."""
    tree = ast.parse(path.read_text())
    package = module.rsplit(".", 1)[0] if "." in module else ""
    if path.name == "__init__.py":
        package = module
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and node.module.startswith("django_joblock"):
                target = node.module[len("django_joblock") :].lstrip(".")
            else:
                continue
            names = [alias.name for alias in node.names]
            if not node.module and node.level:  # from . import a, b: each is a module
                for name in names:
                    found.append(
                        (
                            ".".join(filter(None, [target, name])),
                            [],
                            id(node) in top_level,
                            node.lineno,
                        )
                    )
                continue
            found.append((target, names, id(node) in top_level, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("django_joblock."):
                    target = alias.name[len("django_joblock.") :]
                    found.append((target, [], id(node) in top_level, node.lineno))
    return found


MODULES = _modules()
LAYERS = _layers()


def test_every_module_has_a_layer():
    missing = sorted({_component(m) for m in MODULES} - set(LAYERS) - {"__init__", "migrations"})
    assert not missing, f"modules in no layer of docs/architecture.md: {missing}"
    unknown = sorted(set(LAYERS) - {_component(m) for m in MODULES})
    assert not unknown, f"docs/architecture.md names modules that do not exist: {unknown}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _component(m) in LAYERS))
def test_imports_go_down_never_up(module):
    layer, name = LAYERS[_component(module)]
    wrong = []
    for target, _names, _top, line in _imports(module, MODULES[module]):
        component = _component(target)
        if component in ("__init__", _component(module)) or component not in LAYERS:
            continue
        if LAYERS[component][0] > layer:
            wrong.append(f"line {line}: {target} ({LAYERS[component][1]})")
    assert not wrong, f"{module} ({name}) imports upwards: {wrong}"


def test_no_private_names_are_imported_across_modules():
    found = []
    for module, path in MODULES.items():
        for target, names, _top, line in _imports(module, path):
            if target == module:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                found.append(f"{module}:{line} imports {private} from {target}")
    assert not found, found


def test_no_import_cycles_at_module_level():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, names, top, _line in _imports(module, path):
            if not top:
                continue
            for candidate in [target, *(f"{target}.{n}" for n in names)]:
                if candidate in MODULES and candidate != module and candidate != "":
                    graph[module].add(candidate)
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_the_check_itself_sees_a_wrong_import(tmp_path, monkeypatch):
    """Negative control: an upward import in a module is reported."""
    fake = tmp_path / "conf.py"
    fake.write_text("from .admin import something\n")
    imports = _imports("conf", fake)
    assert imports == [("admin", ["something"], True, 1)]
    assert LAYERS["admin"][0] > LAYERS["conf"][0]
