"""What both adapters show of their replica, alike: plain reads of the strategy's options and its replica.

:class:`AdapterViews` is a base of the Trainer's strategies (:mod:`lightning_loco.trainer.views` adds what only
they show) and of the Fabric strategies, so that ``strategy.algorithm``, ``strategy.num_replicas``,
``strategy.driver`` and the others read the same under either loop. No Lightning here.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.replica.layout import ReplicaLayout
from lightning_loco.replica.modes import TransportFactory
from lightning_loco.replica.options import Options
from lightning_loco.replica.replica import Replica
from lightning_loco.replica.run import ReplicaRun


class AdapterViews:
    """Properties over the strategy's ``options`` and ``replica`` (set by the strategy when it is built)."""

    options: Options
    replica: Replica  # the Lightning-free replica the strategy adapts its hooks to

    @property
    def algorithm(self) -> OuterAlgorithm:
        return self.options.algorithm

    @property
    def sync_every(self) -> int:
        return self.options.sync_every

    @property
    def ranks_per_replica(self) -> int:
        return self.options.ranks_per_replica

    @property
    def num_replicas(self) -> int:
        return self.replica.num_replicas

    @property
    def replica_index(self) -> int:
        return self.replica.replica_index

    @property
    def layout(self) -> ReplicaLayout:
        """Whole or FSDP2-sharded replicas (:mod:`lightning_loco.replica.layout`)."""
        return self.replica.layout

    @property
    def transport_factory(self) -> TransportFactory:
        return self.replica.transport_factory

    @transport_factory.setter
    def transport_factory(self, factory: TransportFactory) -> None:
        self.replica.transport_factory = factory

    @property
    def run(self) -> Optional[ReplicaRun]:
        """The replica's run of rounds during training (None otherwise)."""
        return self.replica.run

    @run.setter
    def run(self, run: Optional[ReplicaRun]) -> None:
        self.replica.run = run

    @property
    def driver(self) -> Any:
        """The replica's :class:`~lightning_loco.driver.driver.OuterStepDriver` during training (None otherwise)."""
        return self.replica.driver
