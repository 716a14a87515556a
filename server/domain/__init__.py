"""The coordinator's rules, apart from SQL, HTTP and clocks.

- :mod:`.state`: jobs, their ranks (column arrays) and checkpoints, as held in memory.
- :mod:`.changes`: what one decision changed, for the repository to write and the metrics
  to count.
- :mod:`.jobs`, :mod:`.ranks`, :mod:`.checkpoints`, :mod:`.tuning`, :mod:`.generation`:
  the rules, each ``decide(job, input, now) -> (reply, changes)``.
- :mod:`.views`: state -> the protocol's public models.

Nothing here does I/O or reads a clock: the tests run every rule on plain objects.
"""
