"""Elastic replicas: each replica is its own job, and replicas that die or join do not stop the others.

torchft (``pip install lightning-loco[elastic]``) is the engine: its Lighthouse agrees on the live
replicas (heartbeats and quorums), and its reconfigurable gloo process group carries the exchanges of
each membership. Built here around it:

* :mod:`~lightning_loco.elastic.config`: the strategies' elastic arguments, checked when the strategy
  is built (no torchft needed to import it);
* :mod:`~lightning_loco.elastic.lighthouse`: a Lighthouse server (``lightning-loco lighthouse``);
* :mod:`~lightning_loco.elastic.membership`: the agreed membership of each stretch of outer steps,
  refreshed in the background, and the state a joining replica heals from;
* :mod:`~lightning_loco.elastic.transport`: a ``Transport`` over the members of the current membership,
  where a partner that fails leaves this replica to finish the round alone;
* :mod:`~lightning_loco.elastic.straggler`: a round with a live partner that is late
  (``straggler_timeout``), left out of that round alike by every member;
* :mod:`~lightning_loco.elastic.plugin`: the driver's plug-in that switches memberships between rounds
  (:mod:`lightning_loco.plugins`), heals joiners and keeps the records of each round.

Only ``config`` is imported by the strategies; the rest imports torchft.
"""

from lightning_loco.elastic.config import ElasticConfig, require_torchft

__all__ = ["ElasticConfig", "require_torchft"]
