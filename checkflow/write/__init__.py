"""The write side of a checkpoint, in the order a save runs.

- ``decisions``: is step N due? (``FixedInterval``; ``AutoInterval``, the coordinator's interval);
- ``backpressure``: a due checkpoint while storage is behind waits for a buffer set or skips;
- ``snapshot``: phase 1, copy the state into reused host buffers (two sets);
- ``persist``: phase 2, encode and write this rank's part on a background thread;
- ``datafiles``: how encoded chunks are boxed, packed into data files and checksummed;
- ``commit``: which rank writes ``MANIFEST.json``, and the write that makes a step visible;
- ``measure``: what a checkpoint costs the training loop, for ``every="auto"``;
- ``stats``: the one record of what was done.

``checkflow.checkpointer.Checkpointer`` wires them together. Nothing is imported here, so
that ``checkflow.write.commit`` can be imported by the cross-rank agreement code without
pulling in the snapshot machinery.
"""
