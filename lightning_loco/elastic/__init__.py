"""Elastic replicas: each replica is its own job, and replicas that die or join do not stop the others.

torchft (``pip install lightning-loco[elastic]``) is the engine: its Lighthouse agrees on the live
replicas (heartbeats and quorums), and its reconfigurable gloo process group carries the exchanges of
each membership. Built here around it, one concept a module:

* :mod:`~lightning_loco.elastic.config`: ``ElasticConfig``, the strategies' ``elastic=`` option;
* :mod:`~lightning_loco.elastic.lighthouse`: a Lighthouse server (``lightning-loco lighthouse``);
* :mod:`~lightning_loco.elastic.plan`: what a quorum means for the next membership, derived alike by all;
* :mod:`~lightning_loco.elastic.membership`: the agreed membership of each stretch of outer steps,
  refreshed in the background;
* :mod:`~lightning_loco.elastic.healing`: when a joiner heals and from whom (the orchestration of a switch);
* :mod:`~lightning_loco.elastic.state_transfer`: how a state crosses (the wire protocol of a heal);
* :mod:`~lightning_loco.elastic.heal_digests`: a heal checked against the donor's digests (``verify_heal``);
* :mod:`~lightning_loco.elastic.keys`: every store key, in one place;
* :mod:`~lightning_loco.elastic.ranks`: a replica of several ranks as one member;
* :mod:`~lightning_loco.elastic.works`: the posted operations of an exchange, each with its partner;
* :mod:`~lightning_loco.elastic.transport`: a ``Transport`` over the members of the current membership,
  where a partner that fails leaves this replica to finish the round alone;
* :mod:`~lightning_loco.elastic.straggler`: a round with a live partner that is late
  (``straggler_timeout``), left out of that round alike by every member;
* :mod:`~lightning_loco.elastic.plugin`: the driver's plug-in that switches memberships between rounds
  (:mod:`lightning_loco.driver.plugins`), heals joiners and keeps the records of each round;
* :mod:`~lightning_loco.elastic.waiting`: the main thread's waits, in slices that let signals in.

Nothing here imports torchft at module level: it is imported where it is used, once a strategy with
``elastic=`` is built (``require_torchft`` names the extra to install when it is missing).
"""

from lightning_loco.elastic.config import ElasticConfig, require_torchft

__all__ = ["ElasticConfig", "require_torchft"]
