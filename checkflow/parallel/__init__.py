"""Checkpointing across ranks: process groups (``groups``), which rank writes which box of
each tensor (``sharding``), agreement through the job's c10d store (``agreement``), and the
adapters between live state objects and a checkpoint (``adapters``).

Every private torch function the runtime calls is in ``_compat`` (the launcher's overrides
of torch's elastic agent are in ``checkflow.launch.agent`` and ``checkflow.launch.warm``,
see docs/ARCHITECTURE.md, "Private APIs"). This package reads no
checkpoint: ``checkflow.read`` imports it (for layouts), never the other way round.
"""
