"""Helpers shared by the tests, in one place; the fixtures built on them are in conftest.py.

- :mod:`tests.support.net`: :func:`free_port`, :func:`wait_until`;
- :mod:`tests.support.paths`: the repository root, and the examples as modules;
- :mod:`tests.support.s3`: fake AWS credentials, ``storage_options`` for moto, a fault proxy
  (failed requests, and outages that drop every connection);
- :mod:`tests.support.moto_server`: a moto S3 server, in this process or its own;
- :mod:`tests.support.coordinator`: a real coordinator (subprocess or thread) and ranks;
- :mod:`tests.support.jobs`: ``tests/launch/_ddp_job.py`` under ``checkflow run``, its
  event logs, and the recovery from each fault (seconds, steps redone, where time went).

Imported as ``tests.support.<module>`` (the repository root is on ``sys.path`` through
pytest's ``pythonpath`` setting); nothing here edits ``sys.path``.
"""
