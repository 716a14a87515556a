"""The write side: phase 1 (``snapshot``), phase 2 (``persist``) and the ``commit`` protocols.

Nothing is imported here, so that ``checkflow.write.commit`` stays importable by the
distributed agreement code without pulling in the snapshot machinery.
"""
