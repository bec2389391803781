"""Print the requirements/lock.txt pins of the packages a requirements ``.in`` file names.

    python docker/pins_from_lock.py docker/airflow-requirements.in requirements/lock.txt > pins.txt

An image extending a base that already holds many packages (the official Airflow image) installs
only these pins, so it gets the versions the tests ran without re-resolving the base image.
Exits 2 naming every package the lock does not pin.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503 normalised name: ``PyYAML`` and ``pyyaml`` are the same package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requested_names(text: str) -> list[str]:
    """Package names in a requirements ``.in`` text (comments, blanks and extras dropped)."""
    names = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _NAME.match(line)
        if match is None or line.startswith("-"):
            raise ValueError(f"cannot read a package name from requirement line {line!r}")
        names.append(match.group(1))
    return names


def lock_pins(text: str) -> dict[str, str]:
    """``canonical name -> 'name==version'`` for every ``name==version`` line of a lock file."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name = line.split("==", 1)[0].split("[", 1)[0].strip()
            pins[canonical(name)] = line.split(";", 1)[0].strip()
    return pins


def pins_for(requested: str, lock: str) -> list[str]:
    """The lock's pins of the requested packages, in the requested order."""
    pins = lock_pins(lock)
    names = requested_names(requested)
    missing = [n for n in names if canonical(n) not in pins]
    if missing:
        raise LookupError(
            f"not pinned in the lock: {', '.join(missing)} "
            "(add them to requirements/base.in and re-lock, or drop them from the .in file)"
        )
    return [pins[canonical(n)] for n in names]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: pins_from_lock.py REQUIREMENTS.in LOCK.txt", file=sys.stderr)
        return 2
    requested, lock = (Path(a) for a in argv)
    try:
        lines = pins_for(requested.read_text(), lock.read_text())
    except (LookupError, ValueError) as exc:
        print(f"pins_from_lock: ERROR: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
