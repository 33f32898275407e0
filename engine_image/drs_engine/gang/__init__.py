"""Engines wider than a node: one engine over several pods, launched as a gang over one Ray cluster.

* :mod:`.spec` — the gang from the pod's environment (``drs_protocol.gang``), and the ``ray start``
  command lines with a minimal footprint, bound to the pod's address;
* :mod:`.leader` — rank 0: starts the Ray head, waits until every rank joined, brings the engine up,
  watches every rank, and ends the process when one is lost (its pod restarts, the ranks with it);
* :mod:`.worker` — ranks 1..W-1: join the leader's Ray cluster and serve only ``/health``;
* :mod:`.shards` — the sim backend's multi-rank mode: one Ray actor per GPU in a placement group
  spanning the joined nodes.
"""
