"""The code blocks of README.md and docs/*.md, and how the docs test runs them.

Every ``python`` and ``bash`` block carries a directive in an HTML comment on the line right
before its opening fence (invisible when the Markdown is rendered)::

    <!-- docs: file shop/jobs.py -->      append the block to that file of the project
    <!-- docs: run -->                    run it (python: ``manage.py shell``; bash: in the
                                          project directory, ``python`` is the test interpreter)
    <!-- docs: run-as COMMAND -->         run COMMAND instead (e.g. a worker with ``--burst``)
    <!-- docs: skip REASON -->            not run; the reason says why (a server that never
                                          ends, an install into the reader's environment...)

A block without a directive is an error, so a new example cannot slip past the test. Files
are assembled and blocks run in document order, README.md first, then docs/ alphabetically.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
_DIRECTIVE = re.compile(r"<!--\s*docs:\s*(file|run-as|run|skip)\b\s*(.*?)\s*-->\s*\Z")
_FENCE = re.compile(r"(`{3,})\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str  # "python" or "bash"
    action: str  # "file", "run", "run-as" or "skip"
    argument: str  # the file, the command or the reason
    code: str

    @property
    def where(self) -> str:
        return f"{_shown(self.path)}:{self.line}"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


class DirectiveError(ValueError):
    """A runnable block without a valid directive."""


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path) -> list[Block]:
    """The python and bash blocks of one Markdown file, with their directives."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        stripped = lines[index].lstrip()
        indent = len(lines[index]) - len(stripped)  # a block inside a list item
        opening = _FENCE.match(stripped)
        if not opening:
            index += 1
            continue
        fence, info = opening.group(1), opening.group(2).lower()
        end = index + 1
        while end < len(lines) and not lines[end].lstrip().startswith(fence):
            end += 1
        language = LANGUAGES.get(info)
        if language is not None:
            previous = lines[index - 1] if index else ""
            found = _DIRECTIVE.match(previous.strip())
            where = f"{_shown(path)}:{index + 1}"
            if found is None:
                raise DirectiveError(
                    f"{where}: a {language} block without a '<!-- docs: file|run|run-as|skip "
                    "... -->' line right before it (see tests/docblocks.py)"
                )
            action, argument = found.group(1), found.group(2)
            if action != "run" and not argument:
                raise DirectiveError(f"{where}: 'docs: {action}' needs an argument")
            if action == "file" and language != "python":
                raise DirectiveError(f"{where}: only python blocks can be files")
            code = "\n".join(line[indent:] for line in lines[index + 1 : end])
            blocks.append(Block(path, index + 1, language, action, argument, code))
        index = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for doc in documents() for block in parse(doc)]
