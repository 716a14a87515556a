"""Moved to ``checkflow.write``: kept for code that imports the commit contract from here.

``checkflow.parallel.agreement`` (the cross-rank ``StoreCommit``) imports ``CommitProtocol``
and ``RankResult`` from this path; new code imports them from ``checkflow.write.commit``.
"""

from __future__ import annotations

from checkflow.write.commit import CommitProtocol, RankResult, SingleProcessCommit

__all__ = ["CommitProtocol", "RankResult", "SingleProcessCommit"]
