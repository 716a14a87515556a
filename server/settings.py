"""Coordinator settings: command-line options override ``CHECKFLOW_*`` environment variables."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from checkflow.protocol import MAX_SECONDS


def default_db_path() -> Path:
    """``$XDG_DATA_HOME/checkflow/coordinator.db`` (``~/.local/share`` when unset)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "checkflow" / "coordinator.db"


class Settings(BaseSettings):
    """How one coordinator process runs. Every field reads ``CHECKFLOW_<NAME>`` too."""

    model_config = SettingsConfigDict(env_prefix="CHECKFLOW_", extra="ignore")

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(default=8470, ge=0, le=65535)
    """TCP port (0 picks a free one)."""
    db: str = Field(default_factory=lambda: str(default_db_path()))
    """Where every job, rank, checkpoint and event is kept: a path (SQLite, the default:
    one process) or ``postgresql://USER@HOST:PORT/DBNAME`` (several replicas may serve
    from one database; ``pip install 'checkflow[postgres]'``)."""
    advertise_url: str | None = None
    """How the other replicas and the clients reach this one (``http://HOST:PORT``): the
    target of their 307 redirects to the jobs it serves. Default ``http://host:port``. Used
    with a PostgreSQL ``db`` only."""
    token: str | None = None
    """Bearer token required on every ``/v1`` request; None disables auth (local use only)."""
    token_file: Path | None = None
    """A file holding the token (a Docker or Kubernetes secret mounted as a file), read at
    startup when ``token`` is not given: the token stays out of the environment and argv."""
    detector_period_s: float = Field(default=0.2, gt=0, le=10)
    """How often the failure detector sweeps; detection latency is timeout + this at most."""
    hang_timeout_s: float | None = Field(default=None, ge=0.1, le=MAX_SECONDS)
    """Hang timeout of jobs that set none: a rank whose step stands still this long is
    hung. None: derived from each job's step times (see ``domain/progress.py``)."""
    heartbeat_flush_s: float = Field(default=0.05, ge=0, le=1)
    """Heartbeat fields are written to SQLite in one commit this often instead of one per
    heartbeat (0: one per heartbeat). What a SIGKILL can lose of them is harmless: see
    ``Repository.save``."""
    fast_protocol: bool = True
    """``checkflow serve`` answers accepted heartbeats inside uvicorn's HTTP parser
    (``api/fastproto.py``); False: every request goes through ASGI (a fallback, and the
    baseline of ``benchmarks/coordinator.py``)."""
    retune_period_s: float = Field(default=1.0, gt=0, le=60)
    """How often each job's checkpoint interval is recomputed from the ranks' reports."""
    warmup_interval: int = Field(default=10, ge=1)
    """Checkpoint interval (steps) used until a checkpoint cost has been reported."""
    sync_storage: bool = True
    """List ``<uri>/step-*/MANIFEST.json`` at startup and job creation to learn commits."""
    storage_allow: list[str] = Field(default_factory=list)
    """Storage the coordinator may read itself (``--storage-allow``, repeatable):
    ``SCHEME`` or ``SCHEME://HOST[:PORT]``, e.g. ``s3://ckpt-bucket`` or ``file``. Default
    none: a job's ``storage_uri`` is never fetched here (the ranks read storage); see
    ``storage_sync.storage_allowed``."""
    log_level: str = "info"
    insecure: bool = False
    """Listen on a non-loopback ``host`` without a token (anyone who reaches the port can
    fail, roll back or commit any job). Without it such a start is refused."""
    docs: bool = False
    """Serve the OpenAPI document at ``/openapi.json``, behind the same token as ``/v1``.
    Off by default: the schema tells a stranger every route."""
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)
    """Largest request body on any route, checked before it is read (413 above it). The
    largest legitimate one, a node heartbeat of 1024 ranks, is about 200 KiB."""
    max_login_bytes: int = Field(default=16 << 10, ge=256, le=1 << 20)
    """Largest body of the dashboard's ``POST /login`` form."""
    login_attempts: int = Field(default=10, ge=1, le=10_000)
    """Wrong tokens one client address may send to ``/login`` in a burst before 429."""
    login_refill_s: float = Field(default=6.0, gt=0, le=3600)
    """After the burst, one more ``/login`` try per this many seconds per address."""

    @field_validator("db", mode="before")
    @classmethod
    def _db_as_text(cls, db: object) -> object:
        return str(db) if isinstance(db, Path) else db

    @field_validator("advertise_url")
    @classmethod
    def _check_advertise_url(cls, url: str | None) -> str | None:
        if url is not None and (problem := advertise_url_problem(url)) is not None:
            raise ValueError(f"advertise_url {url!r}: {problem}")
        return url.rstrip("/") if url is not None else None

    @property
    def replicated(self) -> bool:
        """Whether jobs are held by lease among replicas (a PostgreSQL ``db``)."""
        return self.db.startswith(("postgresql://", "postgres://", "postgresql+psycopg://"))

    def advertised(self) -> str:
        """This replica's URL as the others redirect to it."""
        if self.advertise_url is not None:
            return self.advertise_url
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @model_validator(mode="after")
    def _need_a_reachable_url(self) -> Settings:
        if self.replicated and self.advertise_url is None and self.port == 0:
            raise ValueError("with a PostgreSQL db and port 0, give --advertise-url")
        return self

    @field_validator("storage_allow")
    @classmethod
    def _check_storage_allow(cls, rules: list[str]) -> list[str]:
        for rule in rules:
            scheme, sep, host = rule.partition("://")
            if not scheme.isidentifier() or (sep and not host) or "/" in host or "@" in host:
                raise ValueError(
                    f"storage_allow {rule!r}: give SCHEME or SCHEME://HOST[:PORT], e.g. "
                    "'s3://my-bucket' or 'file'"
                )
        return [r.lower() for r in rules]

    @model_validator(mode="after")
    def _read_token_file(self) -> Settings:
        if self.token is None and self.token_file is not None:
            try:
                token = self.token_file.read_text().strip()
            except OSError as e:
                raise ValueError(f"token_file {self.token_file}: {e.strerror}") from e
            if not token:
                raise ValueError(f"token_file {self.token_file} is empty")
            self.token = token
        return self

    @model_validator(mode="after")
    def _refuse_open_network(self) -> Settings:
        # An open coordinator on a network lets anyone fail or roll back any job: make that
        # a choice (--insecure), never what a missing secret mount silently gives.
        if self.token is None and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"host {self.host} is reachable from other machines and no token is set: "
                "give --token-file PATH (or CHECKFLOW_TOKEN), or --insecure to allow it"
            )
        return self


def advertise_url_problem(url: str) -> str | None:
    """What is wrong with an ``--advertise-url`` (None: fine): it must be an http(s) origin,
    ``SCHEME://HOST[:PORT]``, nothing else, since clients are sent there with their token."""
    scheme, sep, rest = url.partition("://")
    rest = rest.rstrip("/")
    if scheme not in ("http", "https") or not sep:
        return "give http://HOST:PORT or https://HOST:PORT"
    if not rest or any(c in rest for c in "/?#@ \\") or not rest.isprintable():
        return "only SCHEME://HOST[:PORT]: no path, query, user or spaces"
    host, _, port = rest.rpartition(":") if not rest.endswith("]") else (rest, "", "")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        return f"bad port {port!r}"
    if not (host or rest):
        return "no host"
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def token_file_warning(path: Path) -> str | None:
    """A warning when the token file can be read by the group or by others, else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # reading it already failed, with its own message
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        return (
            f"token file {path} is readable by other users (mode {stat.filemode(mode)}): "
            f"chmod 600 {path}"
        )
    return None
