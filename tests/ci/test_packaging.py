"""The wheel ships every package: setuptools lists them by name in pyproject.toml.

A package missing from that list works in an editable install (the folder is on the path)
and is silently absent from a built wheel, so this compares the list with the folders.
"""

from __future__ import annotations

import re
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


def _names(requirements: list[str]) -> list[str]:
    return [re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements]


def test_the_full_extra_is_what_the_coordinator_install_leaves_out_and_what_the_cli_names():
    """`pip install 'checkflow[full]'`, which the CLI of the coordinator image recommends,
    brings back exactly the packages deploy/install-coordinator.sh skips."""
    from checkflow.cli.output import RUNTIME_ONLY

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = config["project"]["optional-dependencies"]
    script = (REPO / "deploy" / "install-coordinator.sh").read_text()
    skipped = re.search(r'CHECKFLOW_NOT_FOR_COORDINATOR="([^"]+)"', script)
    assert skipped is not None
    assert _names(extras["full"]) == skipped.group(1).split() == list(RUNTIME_ONLY)
    dependencies = set(config["project"]["dependencies"])
    assert set(extras["full"]) <= dependencies, "the same pins as the dependencies"


def test_the_safetensors_extra_that_the_restore_error_names_exists():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert _names(config["project"]["optional-dependencies"]["safetensors"]) == ["safetensors"]
