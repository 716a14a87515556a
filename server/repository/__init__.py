"""The coordinator's persistence: SQLite, its schema, and every SQL statement.

- :mod:`.database`: the connection (WAL, pragmas, transactions, background checkpoints).
- :mod:`.rows`: the schema and the mapping of rows to domain objects.
- :mod:`.repository`: :class:`Repository`, the only user of the two above.
"""

from __future__ import annotations

from checkflow_server.repository.repository import Repository

__all__ = ["Repository"]
