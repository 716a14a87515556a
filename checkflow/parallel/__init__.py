"""Checkpointing across ranks: process groups (``groups``), which rank writes which box of
each tensor (``sharding``), agreement through the job's c10d store (``agreement``), and the
adapters between live state objects and a checkpoint (``adapters``).

Every torch call that is not public API is in ``_compat``. This package reads no
checkpoint: ``checkflow.read`` imports it (for layouts), never the other way round.
"""
