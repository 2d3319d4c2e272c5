"""The reference tables of ``docs/settings.md``, made from the declarations in
:mod:`django_joblock.conf` (``tests/test_settings_reference.py`` keeps the docs equal)."""

from __future__ import annotations

from typing import Any

from django_joblock import conf
from django_joblock.setting_rules import Count, Mapping, Range, Rule, Secret, Text, number


def reference() -> str:
    """The settings reference tables of ``docs/settings.md``, from the declarations (a test
    keeps the docs equal to this)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, declared in conf.KEYS.items():
        rule: Rule = declared.metadata["rule"]
        default = conf.default_of(key)
        if isinstance(rule, Mapping):
            shown = "see below" if key == "ALERTS" else _python(default)
            lines.append(f"| `{key}` | {shown} | {declared.metadata['doc']} |")
            continue
        text = declared.metadata["doc"]
        if isinstance(rule, Range | Count | Text) and rule.allowed():
            text += f"; {rule.allowed()}"
        elif isinstance(rule, Secret):
            text = f"{text} ({rule.allowed()})"
        lines.append(f"| `{key}` | {_python(default)} | {text} |")
    for name, mapping in (("REQUEUE_BACKOFF", conf.BACKOFF), ("ALERTS", conf.ALERT_RULES)):
        lines += ["", f"`{name}` sub-keys (every one optional):", ""]
        alerts = name == "ALERTS"
        lines.append(
            "| sub-key | default | alert | meaning |"
            if alerts
            else "| sub-key | default | meaning |"
        )
        lines.append("| --- | --- | --- | --- |" if alerts else "| --- | --- | --- |")
        for sub, spec in mapping.keys.items():
            cells = [f"`{sub}`", _python(spec.default)]
            if alerts:
                cells.append(f"`{spec.alert}`" if spec.alert else "")
            cells.append(f"{spec.doc}; {spec.range.allowed()}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _python(value: Any) -> str:
    """A default as the settings reference writes it (code in backticks)."""
    if isinstance(value, dict):
        inner = ", ".join(f'"{k}": {number(v)}' for k, v in value.items())
        return f"`{{{inner}}}`"
    if isinstance(value, float):
        shown, _, days = number(value).partition(" ")
        return f"`{shown}`" + (f" {days}" if days else "")
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"
