#!/usr/bin/env bash
# Install the checkflow coordinator, without the training runtime, into the Python
# environment of "${PYTHON:-python3}":
#
#     PYTHON=/opt/venv/bin/python bash deploy/install-coordinator.sh /path/to/checkflow
#
# The Dockerfile runs it; tests/deploy runs it into a fresh venv and starts the coordinator,
# so what the image gets is what CI checks. The coordinator imports no torch (an import
# contract in pyproject.toml), so torch, numpy and the codecs' libraries are left out: the
# image is ~100 MB instead of several GB. The dependency list is read from pyproject.toml,
# so it cannot drift from the package's own. The `postgres` extra comes with it (what
# `pip install 'checkflow[postgres]'` adds: the PostgreSQL driver), so one image serves both
# `--db /data/coordinator.db` (SQLite) and `--db postgresql://...` (replicas).
set -euo pipefail

src="${1:-.}"
python="${PYTHON:-python3}"
# Runtime-only dependencies the coordinator never imports.
export CHECKFLOW_NOT_FOR_COORDINATOR="torch numpy zstandard xxhash"
# The extra the coordinator image carries besides the core dependencies.
export CHECKFLOW_EXTRAS="postgres"

requirements="$("$python" - "$src/pyproject.toml" <<'PY'
import os
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras = project.get("optional-dependencies", {})
dependencies = project["dependencies"] + extras.get(os.environ["CHECKFLOW_EXTRAS"], [])
skip = set(os.environ["CHECKFLOW_NOT_FOR_COORDINATOR"].split())
for requirement in dependencies:
    name = re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0]
    if name.lower() not in skip and name.lower() != "checkflow":
        print(requirement)
PY
)"
mapfile -t requirements <<< "$requirements"
"$python" -m pip install --no-cache-dir --no-deps "$src"
"$python" -m pip install --no-cache-dir "${requirements[@]}"
