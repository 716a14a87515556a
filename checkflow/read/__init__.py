"""The read path: ``reader`` (manifests, checksummed bytes, delta chains), ``plan`` (which
bytes of which chunk fill a box, computed before any read), ``assemble`` (the one executor
that carries a plan out), ``state_dicts`` (a rank's view of a step, or the whole job's) and
``api`` (``load``, ``list_checkpoints``, ``resolve_step``). Errors are in ``errors``.
"""
