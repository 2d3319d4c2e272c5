"""django_joblock/ uses only the public APIs of redis-py, django-redis and rq.

Read from the source (``ast``): an import of a private module or name (a dotted part or a name
starting with ``_``) of ``redis``, ``django_redis`` or ``rq``, and an attribute access
``obj._name`` on anything but ``self`` / ``cls`` (our own objects' privates included: no
module reaches into another's; Django's documented ``_meta`` excepted), fail the test with
the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "django_joblock"
THIRD_PARTY = ("redis", "django_redis", "rq")


# Django's model ``_meta`` is a documented public API (the Model _meta API).
DOCUMENTED = frozenset({"_meta"})


def _private(name: str) -> bool:
    dunder = name.startswith("__") and name.endswith("__")
    return name.startswith("_") and not dunder and name not in DOCUMENTED


def findings(source: str, where: str = "<source>") -> list[str]:
    """Every private use in ``source``, as ``where:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            parts = node.module.split(".")
            if parts[0] in THIRD_PARTY:
                names = [alias.name for alias in node.names]
                if any(map(_private, parts)) or any(map(_private, names)):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {names}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in THIRD_PARTY and any(map(_private, parts)):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_django_joblock_uses_no_private_names_of_its_dependencies():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += findings(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert found == [], "private names used:\n" + "\n".join(found)


def test_the_check_finds_what_it_looks_for():
    """Negative control: each kind of private use is caught."""
    source = (
        "from redis._parsers import Encoder\n"
        "from rq.utils import _private_helper\n"
        "import django_redis._internal\n"
        "conn._sock.sendall(b'x')\n"
        "getattr(queue, '_default_timeout', None)\n"
        "job.__class__\n"
        "self._mine = 1\n"
    )
    found = findings(source)
    assert sorted(line.split(":")[1] for line in found) == ["1", "2", "3", "4", "5"], found


def test_every_public_name_resolves_the_types_users_match_on_included():
    """``from django_joblock import X`` works for each name of ``__all__``: the outcomes and
    policies users compare with (``JobOutcome``, ``OnConflict``) and ``force_release``, too."""
    import django_joblock
    from django_joblock.jobs.outcomes import JobOutcome
    from django_joblock.jobs.spec import OnConflict
    from django_joblock.monitor.control import force_release

    for name in django_joblock.__all__:
        assert getattr(django_joblock, name) is not None, name
    assert django_joblock.JobOutcome is JobOutcome
    assert django_joblock.OnConflict is OnConflict
    assert django_joblock.force_release is force_release
