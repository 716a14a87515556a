"""The ``checkflow`` command: ls, inspect, verify, restore, gc, import-dcp, serve, status.

One module per command, each a thin layer over the library: it parses its arguments, calls
one or two library functions and prints what they return through
:mod:`checkflow.cli.output` (tables, times, sizes, and errors as exit codes). The parser
and the entry point are in :mod:`checkflow.cli.app`.
"""

from __future__ import annotations

from checkflow.cli.app import main

__all__ = ["main"]
