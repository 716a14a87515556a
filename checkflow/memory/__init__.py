"""The RAM tier: each rank's newest checkpoints in node memory, so a restart reads them
back without touching storage.

``area`` (no torch) names the folders: the launcher's agent owns one area per node under
``/dev/shm`` (it outlives the worker processes) and exports it as ``CHECKFLOW_RAM_DIR``;
each rank keeps a checkpoint root of format 1 in it (``rank-RRRRR/``), written by
``tier.RamTier`` through checkflow's own storage layer, so the reader, ``checkflow verify``
and the checksums work on it unchanged.
"""
