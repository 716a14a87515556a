""".ci/check_sizes.py on a tiny tree: it names every module and function over its limit,
exits 1 for them, 0 for a clean tree, and lets an exempt path through without hiding it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "check_sizes.py"


def _function(name: str, body_lines: int, indent: str = "") -> str:
    """A function of exactly ``body_lines + 1`` lines (the ``def`` line and its body)."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, check=False
    )


def _tree(root: Path) -> Path:
    """pkg/ with one module of 401 lines and one with a 61-line method and a 61-line inner
    function, beside modules and functions exactly at the limits."""
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "long_module.py").write_text("".join(f"x{i} = {i}\n" for i in range(401)))
    (pkg / "at_limit.py").write_text("".join(f"x{i} = {i}\n" for i in range(400)))
    methods = "class Box:\n" + _function("fits", 59, "    ") + _function("grows", 60, "    ")
    outer = "def outer():\n" + _function("inner", 60, "    ") + "    return inner\n"
    (pkg / "sub" / "functions.py").write_text(methods + outer + _function("flat", 59))
    return pkg


def test_check_sizes_names_each_offender_and_exits_1(tmp_path: Path) -> None:
    pkg = _tree(tmp_path).resolve()
    result = _run(pkg, "--pyproject", tmp_path / "none.toml")
    assert result.returncode == 1, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:-1]]
    assert rows == [
        ["401", "400", f"{pkg}/long_module.py::<module>"],
        ["61", "60", f"{pkg}/sub/functions.py::Box.grows"],
        ["63", "60", f"{pkg}/sub/functions.py::outer"],
        ["61", "60", f"{pkg}/sub/functions.py::outer.inner"],
    ]
    assert result.stdout.splitlines()[-1].startswith("check_sizes: 4 over the limits")


def test_check_sizes_passes_a_tree_at_the_limits(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "ok.py").write_text(_function("sixty", 59) + "".join(f"y{i} = 0\n" for i in range(340)))
    result = _run(pkg, "--pyproject", tmp_path / "none.toml")
    assert result.returncode == 0, result.stdout
    assert result.stdout.strip() == (
        "check_sizes: 0 over the limits (modules <= 400 lines, functions <= 60), 0 exempt"
    )


def test_check_sizes_reports_exempt_paths_without_failing(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "big.py").write_text("".join(f"x{i} = {i}\n" for i in range(450)))
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        textwrap.dedent(
            """\
            [tool.checkflow.sizes]
            exempt = ["pkg/big.py"]
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "pkg", "--pyproject", str(pyproject)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[1].split() == ["450", "400", "pkg/big.py::<module>", "exempt"]
    assert result.stdout.splitlines()[-1].endswith(", 1 exempt")


def test_check_sizes_refuses_a_missing_folder(tmp_path: Path) -> None:
    result = _run(tmp_path / "nowhere")
    assert result.returncode == 2
    assert "no such folder" in result.stderr


def test_check_sizes_names_exempt_paths_that_no_longer_need_it(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "small.py").write_text("x = 1\n")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[tool.checkflow.sizes]\nexempt = ["pkg/small.py", "pkg/gone.py"]\n')
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "pkg", "--pyproject", str(pyproject)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == (
        "check_sizes: exempt but within the limits (or gone), remove: pkg/gone.py, pkg/small.py"
    )
