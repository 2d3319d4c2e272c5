"""What a pip user gets: the built wheel's files and metadata."""

from __future__ import annotations

import zipfile
from email.parser import Parser
from pathlib import Path

import django
import pytest

pytestmark = pytest.mark.slow  # builds the wheel with pip


def _metadata(wheel: Path) -> tuple[list[str], object]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(archive.read(meta_name).decode())
    return names, meta


def test_wheel_carries_templates_static_migrations_types_and_license(built_wheel):
    names, _meta = _metadata(built_wheel)
    for wanted in (
        "django_joblock/py.typed",
        "django_joblock/templates/admin/django_joblock/dashboard.html",
        "django_joblock/templates/admin/django_joblock/release_confirm.html",
        "django_joblock/static/django_joblock/dashboard.css",
        "django_joblock/migrations/0001_initial.py",
        "django_joblock/management/commands/joblock_worker.py",
    ):
        assert wanted in names, f"{wanted} missing from {built_wheel.name}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert not [n for n in names if "__pycache__" in n or n.startswith("tests/")]


def test_wheel_metadata_names_license_urls_and_every_installable_django(built_wheel):
    _names, meta = _metadata(built_wheel)
    assert meta["License-Expression"] == "MIT"
    urls = dict(value.split(", ", 1) for value in meta.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Changelog", "Issues"} <= set(urls)
    classifiers = meta.get_all("Classifier")
    # The Django this suite runs on installs with the package: its classifier must be there.
    running = f"Framework :: Django :: {django.VERSION[0]}.{django.VERSION[1]}"
    assert running in classifiers, f"add the classifier {running!r}"
    requires = meta.get_all("Requires-Dist")
    rq = next(r for r in requires if r.startswith("rq"))
    assert "<" in rq, f"rq needs an upper bound: {rq}"
