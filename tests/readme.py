"""The shell commands the README and docs/ show, so tests run them exactly as a user types them.

A command is read from the ```bash blocks of README.md and docs/*.md: one shell command per
line (a line ending in ``\\`` or an open quote continues on the next), the comment dropped.
Commands are compared in a canonical form (their words, re-quoted by :func:`shlex.join`), so
spacing and comment columns do not matter and a changed word does.

``command(text)`` hands a test the documented command, failing when no page shows it any more;
``tests/test_readme_commands.py`` fails when a page shows a command that no test (or the
cold-run script) runs and that is not marked as needing a GPU host.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from scripts.devstack import REPO, VENV_BIN

README = REPO / "README.md"


def pages() -> list[Path]:
    """The pages whose commands are checked: the README, then docs/*.md."""
    return [README, *sorted((REPO / "docs").glob("*.md"))]


# <staged URI>, <URI>: what the reader fills in. Optional parts: [--json].
PLACEHOLDER = re.compile(r"<[^<>]+>")


@dataclass(frozen=True)
class Command:
    text: str  # canonical: shlex.join of its words
    where: str  # page:line where it starts
    source: str  # as written (continuation lines joined with newlines)


def words(text: str) -> list[str]:
    """The command's words: comment dropped, ``\\``-newline continuations joined."""
    return shlex.split(text.replace("\\\n", " "), comments=True)


def canonical(text: str) -> str:
    return shlex.join(words(text))


def commands(*paths: Path) -> list[Command]:
    """Every command of the pages' ```bash blocks (default: :func:`pages`), in order."""
    return [cmd for path in (paths or pages()) for cmd in _commands(path)]


def _commands(path: Path) -> list[Command]:
    found: list[Command] = []
    in_block = False
    pending: list[str] = []
    start = 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if pending:
                raise ValueError(f"{path}:{start}: unterminated command {' '.join(pending)!r}")
            in_block = line.strip() == "```bash" and not in_block
            continue
        if not in_block:
            continue
        if not pending:
            start = number
        pending.append(line)
        joined = "\n".join(pending)
        if joined.rstrip().endswith("\\"):
            continue
        try:
            split = words(joined)
        except ValueError:  # an open quote: the command goes on
            continue
        pending = []
        if split:
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{start}"
            found.append(Command(shlex.join(split), where, joined))
    return found


def command(text: str, *paths: Path) -> str:
    """The documented command whose words are ``text``'s, as the page writes it (comment
    dropped); fails, naming it, when no page (default: :func:`pages`) shows it."""
    want = canonical(text)
    for cmd in commands(*paths):
        if cmd.text == want:
            return strip_comment(cmd.source)
    names = ", ".join(p.name for p in (paths or pages()))
    raise AssertionError(f"{names}: no page shows the command {want!r} (any more)")


def strip_comment(source: str) -> str:
    """``source`` without its trailing comment (a ``#`` outside quotes, after a blank)."""
    # shlex cannot say where a comment began: cut at the first " #" whose left part splits
    # into the same words as the whole (a "#" inside quotes leaves an open quote or other words).
    whole = words(source)
    for match in re.finditer(r"\s#", source):
        head = source[: match.start()]
        try:
            if words(head) == whole:
                return head.rstrip()
        except ValueError:
            continue
    return source.rstrip()


def run(
    text: str,
    *,
    fill: dict[str, str] | None = None,
    then: str = "",
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run the README's command ``text`` with bash from the repository root, the venv first on
    PATH; ``fill`` replaces its placeholders (``<URI>``, optional ``[--json]`` parts by their
    bracketed text), ``then`` is a line run after it in the same shell (to see what a setting
    did). Returns the finished process (not checked: the caller asserts)."""
    script = command(text)
    for key, value in (fill or {}).items():
        script = script.replace(key, value)
    if then:
        script += "\n" + then
    left = PLACEHOLDER.findall(script)
    if left:
        raise AssertionError(f"placeholders left unfilled in {script!r}: {left}")
    return subprocess.run(
        ["bash", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", **(env or {})},
        timeout=timeout,
    )
