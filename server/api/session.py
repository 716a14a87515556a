"""The dashboard's session cookie: proof that its holder typed the token into the login
form, without being the token.

The value is ``<issued>.<HMAC-SHA256(token, issued)>``: the coordinator checks it without
storing anything (a restart keeps people signed in; a new token signs everyone out), and a
stolen cookie does not reveal the token the ranks use. It expires after :data:`MAX_AGE_S`.
The API accepts it only for reads (see :func:`.deps.authorized`): together with
``SameSite=Strict`` no other site can make a browser change a job with it.
"""

from __future__ import annotations

import hashlib
import hmac

COOKIE = "checkflow_session"
MAX_AGE_S = 12 * 3600
"""How long one sign-in lasts."""
_PURPOSE = b"checkflow dashboard session\x00"


def issue(token: str, now: float) -> str:
    """A cookie value for a browser that just presented ``token``."""
    issued = str(int(now))
    return f"{issued}.{_sign(token, issued)}"


def valid(token: str, value: str | None, now: float) -> bool:
    """Whether ``value`` was issued with ``token`` less than :data:`MAX_AGE_S` ago."""
    issued, _, mac = (value or "").partition(".")
    if not (issued.isascii() and issued.isdigit()) or not 0 <= now - int(issued) <= MAX_AGE_S:
        return False
    return hmac.compare_digest(mac.encode(), _sign(token, issued).encode())


def _sign(token: str, issued: str) -> str:
    return hmac.new(token.encode(), _PURPOSE + issued.encode(), hashlib.sha256).hexdigest()
