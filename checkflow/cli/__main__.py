"""``python -m checkflow.cli``: the same as the installed ``checkflow`` command."""

from __future__ import annotations

import sys

from checkflow.cli import main

sys.exit(main())
