"""The dashboard's files ship in the wheel: pyproject's package data covers every file in
server/dashboard/static/ (an editable install finds them anyway, a wheel would not)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
STATIC = REPO / "server" / "dashboard" / "static"


def test_package_data_covers_every_dashboard_file() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["checkflow_server.dashboard"]
    files = [p.relative_to(STATIC.parent).as_posix() for p in STATIC.iterdir()]
    assert {"static/dashboard.html", "static/login.html", "static/dashboard.js"} <= set(files)
    missed = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert missed == [], "add these to [tool.setuptools.package-data] in pyproject.toml"
