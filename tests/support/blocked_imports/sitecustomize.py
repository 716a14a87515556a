"""Make the packages named in ``CHECKFLOW_TEST_BLOCK_IMPORTS`` impossible to import.

With this folder first on ``PYTHONPATH``, Python imports this file at start-up (``site``
imports ``sitecustomize``), and from then on importing ``numpy`` (say) fails as it does
where numpy is not installed: a ``ModuleNotFoundError`` from the import system. The tests
run the real ``checkflow`` CLI that way, as in the coordinator image (no torch, no numpy)
or an install without the ``safetensors`` extra, without building such an environment.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

BLOCKED = frozenset(os.environ.get("CHECKFLOW_TEST_BLOCK_IMPORTS", "").split())


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if BLOCKED:
    sys.meta_path.insert(0, _Blocked())
