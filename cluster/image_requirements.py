"""The third-party requirements of a set of the project's extras, read from pyproject.toml.

The image installs its dependencies in a layer of their own, before the project's source is
copied in, so that a source edit does not reinstall torch. This file is what that layer runs
(``python3 image_requirements.py pyproject.toml runtime,server``: one requirement per line),
both in the Dockerfile and in ``conveyor image build``; it needs only the standard library,
because it runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

_SELF = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*\[([^\]]*)\]\s*$")


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """The base dependencies plus those of each extra, self-references (``conveyor[a,b]``)
    expanded, duplicates dropped, in first-seen order."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    name = project["name"].lower()
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise ValueError(
            f"unknown extra(s) {', '.join(unknown)}: pyproject.toml defines {', '.join(optional)}"
        )
    out: list[str] = []
    seen_extras: set[str] = set()

    def add(reqs: list[str]) -> None:
        for req in reqs:
            self_ref = _SELF.match(req)
            if self_ref and self_ref.group(1).lower() == name:
                for extra in (e.strip() for e in self_ref.group(2).split(",")):
                    if extra and extra not in seen_extras:
                        seen_extras.add(extra)
                        add(optional[extra])
            elif req not in out:
                out.append(req)

    add(project.get("dependencies", []))
    for extra in extras:
        if extra not in seen_extras:
            seen_extras.add(extra)
            add(optional[extra])
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: image_requirements.py PYPROJECT EXTRA[,EXTRA...]", file=sys.stderr)
        return 2
    extras = [e.strip() for e in argv[1].split(",") if e.strip()]
    try:
        print("\n".join(requirements(Path(argv[0]), extras)))
    except ValueError as exc:
        print(f"image_requirements.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
