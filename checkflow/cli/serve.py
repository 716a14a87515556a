"""``checkflow serve``: run the coordinator on uvicorn until interrupted.

Every option also reads ``CHECKFLOW_<OPTION>`` (pydantic-settings); an option given on the
command line wins.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

from checkflow.cli.arguments import Command
from checkflow.cli.output import EXIT_FAILED, EXIT_OK, CliError, line

_SETTINGS = ("host", "port", "db", "token", "token_file", "hang_timeout_s", "log_level")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (default 8470)")
    parser.add_argument("--db", help="SQLite database (default: ~/.local/share/checkflow/...)")
    parser.add_argument("--token", help="bearer token required on /v1 (default: none)")
    parser.add_argument(
        "--token-file", metavar="PATH", help="read the token from this file (a mounted secret)"
    )
    parser.add_argument(
        "--hang-timeout",
        dest="hang_timeout_s",
        type=float,
        metavar="S",
        help="seconds a rank's step may stand still before it is hung, for jobs that set no "
        "hang_timeout (default: derived from each job's step times, at least 60 s)",
    )
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    """Run the coordinator until interrupted; exit 1 when it could not start."""
    try:
        import pydantic
        import uvicorn
        from checkflow_server.app import create_app
        from checkflow_server.settings import Settings
    except ImportError as e:
        raise CliError(
            f"the coordinator is unavailable in this install ({e}); reinstall checkflow "
            "with 'pip install checkflow'"
        ) from e
    given = {k: getattr(args, k) for k in _SETTINGS if getattr(args, k) is not None}
    try:
        settings = Settings(**given)
    except pydantic.ValidationError as e:
        raise CliError(f"bad setting: {e}") from None
    # force: the CLI's own logging setup must not keep the service's level and format out.
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        force=True,
    )
    try:
        app = create_app(settings)
    except Exception as e:  # e.g. an unreadable database: say what, not a traceback
        raise CliError(f"cannot open {settings.db}: {e}", EXIT_FAILED) from e
    line(
        f"checkflow coordinator on http://{settings.host}:{settings.port} (db {settings.db}"
        f"{', token required' if settings.token else ', no token'})"
    )
    # One worker: the state lives in this process. uvloop + httptools measured 1.6-2x the
    # throughput of asyncio + h11 for heartbeats.
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        workers=1,
        loop=_pick("uvloop", "auto"),
        # The coordinator's own httptools protocol when it has one (heartbeats answered
        # without an ASGI task per request: see server/api/fastproto.py).
        http=getattr(app.state, "http_protocol", None) or _pick("httptools", "auto"),
        log_level=settings.log_level,
        access_log=False,
    )
    server = uvicorn.Server(config)
    server.run()
    return EXIT_OK if server.started else EXIT_FAILED


def _pick(module: str, fallback: str) -> str:
    return module if importlib.util.find_spec(module) is not None else fallback


COMMAND = Command(
    "serve",
    "run the coordinator service",
    configure,
    run,
    description="Run the coordinator. Every option also reads CHECKFLOW_<OPTION>.",
)
