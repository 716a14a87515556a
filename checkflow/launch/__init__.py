"""``checkflow run``: torchrun's elastic agent, with restarts that always reconnect.

``rendezvous`` gives every restart's workers a store of their own (the cause of issue 10's
failed gloo restarts), ``env`` carries the coordinator settings to the workers, and
``launcher`` puts them together on ``torch.distributed.run``'s options.
"""
