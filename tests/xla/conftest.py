"""tests/xla runs on torch_xla's CPU backend (PJRT_DEVICE=CPU), in the XLA lane only.

torch_xla pins an older torch than the main suite's, so it cannot be installed next to it:
``bash .ci/xla`` (run by ``.ci/run`` after the main suite) makes its own venv with torch
2.9.0 + torch_xla 2.9.0 and runs this folder for real. Where torch_xla is absent (the main
suite's venv) the folder is not collected at all. The lane exports CHECKFLOW_XLA_LANE=1:
there a missing torch_xla is an error, never a silent skip.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("torch_xla") is None:
    if os.environ.get("CHECKFLOW_XLA_LANE") == "1":
        raise RuntimeError("the XLA lane runs without torch_xla: rerun `bash .ci/xla`")
    collect_ignore_glob = ["*.py"]
else:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
