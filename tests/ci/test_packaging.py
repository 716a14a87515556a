"""The wheel ships every package: setuptools lists them by name in pyproject.toml.

A package missing from that list works in an editable install (the folder is on the path)
and is silently absent from a built wheel, so this compares the list with the folders.
"""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def _folders_with_init(root: str, name: str) -> set[str]:
    base = REPO / root
    return {
        ".".join((name, *p.parent.relative_to(base).parts))
        for p in base.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def test_every_package_folder_is_listed_for_the_wheel():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    folders = _folders_with_init("checkflow", "checkflow") | _folders_with_init(
        "server", "checkflow_server"
    )
    assert folders - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - folders == set(), "these listed packages have no folder"
