"""How a process takes part in a run: in one world of every replica (the static launch), or as one
elastic replica that comes and goes on torchft's membership.

A strategy holds one mode object and asks it, instead of branching on elastic mode, for what differs:
the transport and the driver's plug-in, the timeout of the replica's own process groups, how its
errors read and how it is named. :class:`RunMode` is the static launch (Lightning's launchers,
torchrun, SLURM); :class:`ElasticRun` an elastic replica (:mod:`lightning_loco.elastic`). No Lightning
here: the Trainer's and Fabric's strategies pass what they know (a SIGTERM check, the ranks).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Callable, Optional, Union

from lightning_loco.driver.plugins import DriverPlugin
from lightning_loco.elastic import data
from lightning_loco.elastic.config import ElasticConfig, require_torchft
from lightning_loco.elastic.plugin import ElasticPlugin
from lightning_loco.elastic.ranks import ReplicaRankError, restart_advice
from lightning_loco.elastic.transport import ElasticTransportFactory
from lightning_loco.transport import TorchDistributedTransport, Transport

log = logging.getLogger("lightning_loco")
TransportFactory = Callable[..., Transport]


class RunMode:
    """The static launch, one world of every replica: the transport over torch.distributed, no plug-in.
    :class:`ElasticRun` overrides what differs for an elastic replica."""

    elastic: Optional[ElasticConfig] = None

    def transport_factory(self, given: Optional[TransportFactory]) -> TransportFactory:
        """``given`` (a network model, a test's transport), or :class:`TorchDistributedTransport`."""
        return given or TorchDistributedTransport

    def plugin(self, transport: Transport) -> DriverPlugin:
        return DriverPlugin()

    def transport_options(self, check_stop: Callable[[str], None]) -> dict[str, Any]:
        return {}

    def replica_timeout(self, default: Optional[timedelta]) -> Optional[timedelta]:
        """The timeout of the replica's own process groups: the run's."""
        return default

    def replica_name(self, index: int) -> Union[int, str]:
        """How logs name this replica: its index."""
        return index

    def annotate(self, exception: BaseException, global_rank: int, ranks_per_replica: int) -> None:
        """Adds to an error ending this process what the user should do about it (nothing to add here)."""

    def explains_stops(self) -> bool:
        """Whether the end of fit is explained in a log line (elastic replicas stop on their own)."""
        return False

    def sampler_kwargs(self, default: dict[str, Any], rank_in_replica: int, ranks_per_replica: int,
                       seed: int) -> dict[str, Any]:
        """Lightning's ``distributed_sampler_kwargs``: the launch's world already cuts the data (``default``)."""
        return default


class ElasticRun(RunMode):
    """One elastic replica: the elastic transport over the live members, and its plug-in
    (:class:`~lightning_loco.elastic.plugin.ElasticPlugin`), which switches memberships and heals."""

    def __init__(self, config: ElasticConfig) -> None:
        require_torchft()  # fails when the strategy is built, naming the extra to install
        self.elastic = config

    def transport_factory(self, given: Optional[TransportFactory]) -> TransportFactory:
        assert self.elastic is not None
        return ElasticTransportFactory(self.elastic)  # a given factory is refused (rule elastic-own-transport)

    def plugin(self, transport: Transport) -> DriverPlugin:
        return ElasticPlugin(transport)

    def transport_options(self, check_stop: Callable[[str], None]) -> dict[str, Any]:
        """The waits for the Lighthouse and a donor stop on ``check_stop`` (the strategy's SIGTERM check)."""
        return {"check_stop": check_stop}

    def replica_timeout(self, default: Optional[timedelta]) -> Optional[timedelta]:
        """An elastic replica's own operations (DDP's or FSDP2's collectives, a round's agreement) fail within
        ``outer_step_timeout`` when one of its ranks dies: the replica then leaves the membership as a whole
        (:mod:`lightning_loco.elastic.ranks`)."""
        assert self.elastic is not None
        return timedelta(seconds=self.elastic.outer_step_timeout)

    def replica_name(self, index: int) -> Union[int, str]:
        """Elastic replicas' indices change with the membership: their id."""
        assert self.elastic is not None
        return self.elastic.name

    def annotate(self, exception: BaseException, global_rank: int, ranks_per_replica: int) -> None:
        """A replica of several ranks: the error says that the replica leaves the membership as a whole and is
        restarted as a whole (a rank that died fails the others' next operation)."""
        assert self.elastic is not None
        if ranks_per_replica > 1 and isinstance(exception, Exception):
            if not isinstance(exception, ReplicaRankError):  # e.g. gloo's, from DDP's all-reduce: says why
                advice = restart_advice(self.elastic.name, global_rank, ranks_per_replica)
                first = exception.args[0] if exception.args else exception
                exception.args = (f"{first} {advice}", *exception.args[1:])
            log.error("%s: %s", type(exception).__name__, exception)

    def explains_stops(self) -> bool:
        return True

    def sampler_kwargs(self, default: dict[str, Any], rank_in_replica: int, ranks_per_replica: int,
                       seed: int) -> dict[str, Any]:
        """A replica's own data, from its slot or its id (:mod:`lightning_loco.elastic.data`); the launch's world
        is the replica's own ranks, which would give every replica the same batches."""
        assert self.elastic is not None
        config = self.elastic
        return data.sampler_kwargs(config.name, config.data_slots, config.data_slot, ranks_per_replica,
                                   rank_in_replica, seed)


def run_mode(elastic: Optional[ElasticConfig]) -> RunMode:
    """The mode of ``elastic``'s option: the static launch (None) or one elastic replica."""
    return RunMode() if elastic is None else ElasticRun(elastic)
