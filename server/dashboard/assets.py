"""The dashboard's files, read from the installed package (``static/``), never from a CDN."""

from __future__ import annotations

import html
from functools import cache
from importlib import resources

ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
"""What ``/dashboard/{name}`` serves, with its media type; any other name is a 404."""


@cache
def read(name: str) -> str:
    """The text of ``static/<name>`` (read once: package data does not change while we run)."""
    return (resources.files(__package__) / "static" / name).read_text(encoding="utf-8")


def page() -> str:
    """The dashboard page; its script fills it in from the API."""
    return read("dashboard.html")


def login_page(error: str = "") -> str:
    """The sign-in form, with ``error`` (plain text) above it when a sign-in failed."""
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return read("login.html").replace("<!--error-->", message)
