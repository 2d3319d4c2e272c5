"""docs/settings.md's reference tables are the ones made from the settings' declarations, and
every key is declared once (default, rule, docs) in django_joblock/conf.py."""

from __future__ import annotations

import re
from pathlib import Path

from django_joblock import conf
from tests.settings_reference import reference

DOCS = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_docs_carry_the_generated_reference_tables():
    text = DOCS.read_text()
    start = text.index("-->\n\n", text.index("<!-- The tables below")) + len("-->\n\n")
    end = text.index("\n<!-- end of the generated tables -->")
    assert text[start:end] == reference(), (
        "docs/settings.md is out of date: paste tests.settings_reference.reference()"
    )


def test_every_key_is_documented_with_its_default_and_range():
    table = reference()
    for key, declared in conf.KEYS.items():
        row = re.search(rf"^\| `{key}` \| (?P<default>[^|]+) \| (?P<doc>[^|]+) \|$", table, re.M)
        assert row, key
        assert declared.metadata["doc"] in row["doc"]
        rule = declared.metadata["rule"]
        if isinstance(rule, conf.Range):
            assert rule.allowed() in row["doc"], key
    assert set(conf.DEFAULTS) == set(conf.KEYS)


def test_defaults_are_valid_and_are_what_get_returns(settings):
    settings.JOBLOCK = {}
    assert conf.problems(conf.DEFAULTS) == []
    current = conf.get()
    for key, value in conf.DEFAULTS.items():
        assert getattr(current, key) == value, key
