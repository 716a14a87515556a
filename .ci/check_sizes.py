#!/usr/bin/env python3
"""Fail when a module or a function has grown past what a reader takes in at once.

Issue 9's bar: every module of ``checkflow/`` and ``server/`` has at most 400 lines and
every function (method, nested function, lambda excluded) at most 60. A module that size
holds one concern; a function that size fits on a screen. The check reads the source with
:mod:`ast` only, so it imports nothing from the project and runs before anything is built.

    python .ci/check_sizes.py                  # checkflow/ and server/ from the repository root
    python .ci/check_sizes.py some/dir ...     # other trees (the unit test uses a fixture)

It prints one table of the offenders and exits 1 when there is any. Paths listed under
``[tool.checkflow.sizes] exempt`` in pyproject.toml are reported but do not fail the run:
that list is for modules another change is splitting at the time, never a permanent escape.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tomllib  # Python 3.11+, as .ci/run's import-linter needs too

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
DEFAULT_ROOTS = ("checkflow", "server")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Offender:
    """One module or function over its limit."""

    path: str
    name: str  # "<module>" or the function's dotted name inside the module
    lines: int
    limit: int


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.AST) -> Iterator[tuple[str, Function]]:
    """Every function and method with its dotted name (``Class.method``, ``outer.inner``)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, Function]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def check_file(path: Path, shown_as: str, max_module: int, max_function: int) -> list[Offender]:
    """The offenders in one source file: the module itself, then its functions in order."""
    source = path.read_text(encoding="utf-8")
    offenders = []
    module_lines = len(source.splitlines())
    if module_lines > max_module:
        offenders.append(Offender(shown_as, "<module>", module_lines, max_module))
    for name, node in _functions(ast.parse(source, filename=str(path))):
        # From the ``def`` line to the last line of the body (decorators not counted).
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > max_function:
            offenders.append(Offender(shown_as, name, lines, max_function))
    return offenders


def check_tree(root: Path, base: Path, max_module: int, max_function: int) -> list[Offender]:
    """The offenders in every ``.py`` file under ``root``, paths shown relative to ``base``."""
    offenders = []
    for path in sorted(root.rglob("*.py")):
        shown = path.relative_to(base).as_posix() if path.is_relative_to(base) else str(path)
        offenders += check_file(path, shown, max_module, max_function)
    return offenders


def exempt_paths(pyproject: Path) -> set[str]:
    """``[tool.checkflow.sizes] exempt`` of the given pyproject.toml (empty when absent)."""
    if not pyproject.is_file():
        return set()
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    return set(config.get("tool", {}).get("checkflow", {}).get("sizes", {}).get("exempt", []))


def render(offenders: list[Offender], exempt: set[str]) -> str:
    """The offenders as a fixed-width table, the exempt ones marked."""
    header = ("lines", "limit", "where", "")
    rows = [
        (str(o.lines), str(o.limit), f"{o.path}::{o.name}", "exempt" if o.path in exempt else "")
        for o in offenders
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].rjust(widths[0]), row[1].rjust(widths[1]), row[2].ljust(widths[2]), row[3]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", help="trees to check (default: checkflow server)")
    parser.add_argument("--max-module-lines", type=int, default=MAX_MODULE_LINES)
    parser.add_argument("--max-function-lines", type=int, default=MAX_FUNCTION_LINES)
    parser.add_argument(
        "--pyproject", type=Path, default=REPO / "pyproject.toml", help="where the exempt list is"
    )
    args = parser.parse_args(argv)
    roots = [Path(r) for r in args.roots] or [REPO / r for r in DEFAULT_ROOTS]
    missing = [str(r) for r in roots if not r.is_dir()]
    if missing:
        print(f"check_sizes: no such folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    base = REPO if not args.roots else Path.cwd()
    limits = (args.max_module_lines, args.max_function_lines)
    offenders = [o for root in roots for o in check_tree(root.resolve(), base.resolve(), *limits)]
    exempt = exempt_paths(args.pyproject)
    failing = [o for o in offenders if o.path not in exempt]
    if offenders:
        print(render(offenders, exempt))
    print(
        f"check_sizes: {len(failing)} over the limits (modules <= {args.max_module_lines} lines, "
        f"functions <= {args.max_function_lines}), {len(offenders) - len(failing)} exempt"
    )
    stale = sorted(exempt - {o.path for o in offenders})
    if stale:
        print(f"check_sizes: exempt but within the limits (or gone), remove: {', '.join(stale)}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
