"""Request bodies parsed as JSON is written: no ``NaN``, no ``Infinity``, no ``1e400``.

Python's ``json.loads`` accepts ``NaN`` and ``Infinity`` and turns ``1e400`` into
``inf``. A model refuses them, but the 422 then carries the value in its ``input``, and a
reply holding ``NaN`` cannot be encoded as JSON: the client got a 500. Refusing them while
parsing makes them a ``json_invalid`` 422 like any other malformed body. Every API router
uses :class:`StrictJSONRoute` (``APIRouter(route_class=StrictJSONRoute)``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


def loads(body: bytes) -> Any:
    """``body`` as JSON; :class:`json.JSONDecodeError` for a non-finite number."""
    return json.loads(body, parse_constant=_refuse_constant, parse_float=_finite)


def _refuse_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a JSON number: send a finite number", name, 0)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise json.JSONDecodeError(f"{text} is out of range of a float: send a finite one", text, 0)
    return value


class StrictJSONRequest(Request):
    """A request whose :meth:`json` refuses non-finite numbers (see the module docstring)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An API route whose body is parsed by :class:`StrictJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


def encodable(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its text (``"nan"``, ``"inf"``):
    what an error reply echoes back must encode as JSON whatever the client sent."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encodable(v) for v in value]
    return value
