"""checkflow inside the trainers people already use; each module is an optional extra.

- ``checkflow.integrations.lightning``: a Lightning ``Callback`` (frequent asynchronous
  checkpoints, resumed on ``fit``) and ``checkflow.integrations.lightning_io``: a
  ``CheckpointIO`` plugin (``trainer.save_checkpoint`` / ``ckpt_path=`` through checkflow).
  ``pip install checkflow[lightning]``.
- ``checkflow.integrations.transformers``: a ``transformers.TrainerCallback``.
  ``pip install checkflow[transformers]``.

Nothing is imported here: ``import checkflow`` never needs a trainer package, and each
module imports its framework when it is imported itself.
"""
