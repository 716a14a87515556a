"""``checkflow run``: torchrun's elastic agent, owning recovery.

``launcher`` puts torch's options and rendezvous together and launches :mod:`agent`'s
``CheckflowAgent`` (torch's ``LocalElasticAgent`` that kills within a short grace, reports
crashes to the coordinator and restarts its workers when the job moved on);
``rendezvous`` gives every restart's workers a store of their own (the cause of issue 10's
failed gloo restarts); ``watch`` is the agent's view of the job at the coordinator and
``recovery`` the decisions made from it.
"""
