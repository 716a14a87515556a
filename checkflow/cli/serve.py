"""``checkflow serve``: run the coordinator on uvicorn until interrupted.

Every option also reads ``CHECKFLOW_<OPTION>`` (pydantic-settings); an option given on the
command line wins. The token belongs in ``--token-file`` or ``CHECKFLOW_TOKEN``: a
``--token`` on the command line is readable by every user in ``/proc/PID/cmdline``, so it
still works but warns (it goes away in a later release).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

from checkflow.cli.arguments import Command
from checkflow.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    TOKEN_ON_COMMAND_LINE,
    CliError,
    StderrHandler,
    line,
    warning,
)

_SETTINGS = (
    "host",
    "port",
    "db",
    "advertise_url",
    "token",
    "token_file",
    "hang_timeout_s",
    "storage_allow",
    "log_level",
    "insecure",
    "docs",
    "max_body_bytes",
    "max_login_bytes",
    "login_attempts",
    "login_refill_s",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (default 8470)")
    parser.add_argument(
        "--db",
        help="a SQLite file (default: ~/.local/share/checkflow/...) or "
        "postgresql://USER@HOST:PORT/DBNAME, which several replicas may share "
        "(needs pip install 'checkflow[postgres]')",
    )
    parser.add_argument(
        "--advertise-url",
        metavar="URL",
        help="with a PostgreSQL --db: this replica's URL, where the others redirect "
        "requests for the jobs it serves (default http://HOST:PORT)",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="read the bearer token required on /v1 from this file (mode 600; a mounted "
        "secret); or set CHECKFLOW_TOKEN",
    )
    parser.add_argument(
        "--token", help="deprecated: the token on the command line, readable by every user"
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow a --host other than loopback without a token (anyone can change jobs)",
    )
    parser.add_argument(
        "--docs",
        action="store_true",
        default=None,
        help="serve the OpenAPI document at /openapi.json, behind the token (default: off)",
    )
    limits = parser.add_argument_group("limits (checked before a request's body is read)")
    limits.add_argument(
        "--max-body-bytes", type=int, metavar="N", help="largest request body (default 1 MiB)"
    )
    limits.add_argument(
        "--max-login-bytes", type=int, metavar="N", help="largest /login form (default 16 KiB)"
    )
    limits.add_argument(
        "--login-attempts",
        type=int,
        metavar="N",
        help="wrong tokens per client address at /login before 429 (default 10)",
    )
    limits.add_argument(
        "--login-refill",
        dest="login_refill_s",
        type=float,
        metavar="S",
        help="then one more /login try per S seconds (default 6)",
    )
    _configure_jobs(parser)
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])


def _configure_jobs(parser: argparse.ArgumentParser) -> None:
    """How the coordinator treats jobs: hangs, and the storage it may read itself."""
    parser.add_argument(
        "--hang-timeout",
        dest="hang_timeout_s",
        type=float,
        metavar="S",
        help="seconds a rank's step may stand still before it is hung, for jobs that set no "
        "hang_timeout (default: derived from each job's step times, at least 60 s)",
    )
    parser.add_argument(
        "--storage-allow",
        action="append",
        metavar="SCHEME[://HOST]",
        help="storage the coordinator may list itself to learn commits (repeatable, e.g. "
        "s3://my-bucket or file); default none: it never reads a job's storage_uri",
    )


def run(args: argparse.Namespace) -> int:
    """Run the coordinator until interrupted; exit 1 when it could not start."""
    try:
        import pydantic
        import uvicorn
        from checkflow_server.app import create_app
        from checkflow_server.repository.database import shown
        from checkflow_server.settings import Settings
    except ImportError as e:
        raise CliError(
            f"the coordinator is unavailable in this install ({e}); reinstall checkflow "
            "with 'pip install checkflow'"
        ) from e
    given = {k: getattr(args, k) for k in _SETTINGS if getattr(args, k) is not None}
    if args.token is not None:
        warning(TOKEN_ON_COMMAND_LINE)
    try:
        settings = Settings(**given)
    except pydantic.ValidationError as e:
        raise CliError(f"bad setting: {one_line(e)}") from None
    if settings.token_file is not None and "token" not in given:
        from checkflow_server.settings import token_file_warning

        if (problem := token_file_warning(settings.token_file)) is not None:
            warning(problem)
    # force: the CLI's own logging setup must not keep the service's level and format out.
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=[StderrHandler()],
        force=True,
    )
    try:
        app = create_app(settings)
    except Exception as e:  # e.g. an unreadable database: say what, not a traceback
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CliError(f"cannot open {shown(settings.db)}: {why}", EXIT_FAILED) from e
    line(
        f"checkflow coordinator on http://{settings.host}:{settings.port} (db "
        f"{shown(settings.db)}{', token required' if settings.token else ', no token'}"
        f"{', replica ' + settings.advertised() if settings.replicated else ''})"
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


def one_line(e: Exception) -> str:
    """A pydantic ``ValidationError`` as ``field: problem; ...`` on one line."""
    errors = getattr(e, "errors", None)
    if errors is None:
        return str(e)
    parts = []
    for err in errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _pick(module: str, fallback: str) -> str:
    return module if importlib.util.find_spec(module) is not None else fallback


COMMAND = Command(
    "serve",
    "run the coordinator service",
    configure,
    run,
    description="Run the coordinator. Every option also reads CHECKFLOW_<OPTION>.",
)
