"""Where the repository's files are, and the examples as importable modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
"""The repository root (what a child process needs on ``PYTHONPATH`` to import ``tests``)."""
EXAMPLES = REPO / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a fresh module, imported from its path.

    The examples are scripts, not a package: loading one from its file leaves ``sys.path``
    and ``sys.modules`` as they were, and its ``if __name__ == "__main__"`` block does not
    run (the module is named ``examples.<name>``).
    """
    spec = importlib.util.spec_from_file_location(f"examples.{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no example named {name!r}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
