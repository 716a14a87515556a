"""A moto S3 server on 127.0.0.1 and a free port: in this process, or as its own process.

In this process (:func:`start_moto`) it serves the session's ``s3_endpoint`` fixture. Run as
a script (``python tests/support/moto_server.py``) it prints its port, serves until its
stdin closes, and stops: tests whose server must check credentials (a process-wide switch
in moto) start it that way so the session's server keeps accepting the fake ones. The
script imports only moto, so it needs no ``PYTHONPATH``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
"""This file, to run as a child process: ``[sys.executable, str(SCRIPT)]``."""


def start_moto() -> tuple[Any, str]:
    """A started ``ThreadedMotoServer`` and its endpoint ``http://127.0.0.1:<port>``."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO; the tests' output should show failures only.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


if __name__ == "__main__":
    moto, endpoint = start_moto()
    print(endpoint.rsplit(":", 1)[1], flush=True)
    sys.stdin.read()  # until the test closes our stdin
    moto.stop()
