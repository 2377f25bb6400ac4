"""One replica's outer step while it trains, as any training loop drives it: no Lightning here.

:class:`ReplicaRun` is built when training starts, from the run's options, this process's groups, its
replica layout and its run mode; it builds the transport, the driver and the driver's plug-in, takes
the optimizers' parameters, and is then told of every real inner step. The Trainer's strategies
(:mod:`lightning_loco.trainer`) and the Fabric strategies (:mod:`lightning_loco.fabric`) are thin
adapters of their loops to it, so that both run the same rounds, bit for bit. The simulator
(:mod:`lightning_loco.simulator`) builds each simulated replica's driver with :func:`replica_driver` and
decides its last step with :func:`last_step`, as :class:`ReplicaRun` does.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Protocol, Union

import torch

from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.driver.pacing import AUTO, SharedStepTimes, StepTimes, StoreStepTimes
from lightning_loco.driver.plugins import DriverPlugin, TrainingState
from lightning_loco.replica import checkpoints
from lightning_loco.replica.modes import RunMode
from lightning_loco.replica.options import Options
from lightning_loco.replica.process_groups import ProcessGroups
from lightning_loco.transport import Transport
from lightning_loco.transport.streams import AUTO as AUTO_STREAMS
from lightning_loco.transport.streams import auto_stream_groups


class Layout(Protocol):
    """What the run needs of the replica's layout (:mod:`lightning_loco.replica.layout`)."""

    def flat_parameters(self, params: list[torch.Tensor]) -> FlatParameters: ...

    def transport_options(self) -> dict[str, Any]: ...


_fits = itertools.count()  # every rank counts its fits alike: each fit's step times live under a key of its own


def step_times_of(num_replicas: int) -> Union[StoreStepTimes, SharedStepTimes]:
    """Where ``sync_seconds="auto"`` finds the replicas' step times: the run's ``torch.distributed`` store (the
    default group's, under a prefix of this fit), or, without a process group, this replica's alone."""
    import torch.distributed as dist

    fit = next(_fits)
    if not dist.is_initialized():
        return SharedStepTimes()
    store = dist.distributed_c10d._get_default_store()
    return StoreStepTimes(dist.PrefixStore(f"lightning_loco/step_times/{fit}", store), num_replicas)


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def replica_driver(options: Options, transport: Transport, flats: Iterable[FlatParameters] = (), *, label: str,
                   plugin: Optional[DriverPlugin], clock: Callable[[], float], step_times: Optional[StepTimes],
                   track_norms: bool = False, agree_overlap: Optional[Callable[[int], int]] = None,
                   agree_seconds: Optional[Callable[[float], float]] = None) -> OuterStepDriver:
    """One replica's driver of its rounds over ``transport``, with its plug-in, clock and board of step
    times (``sync_seconds="auto"``), and the ranks' agreement functions where a replica has several; it
    takes ``flats``, the optimizers' parameters (see :func:`add_parameters`). :class:`ReplicaRun` builds
    its driver here, and so does the simulator for each of its replicas."""
    driver = OuterStepDriver(options, transport, label=label, plugin=plugin, clock=clock, agree_overlap=agree_overlap,
                             agree_seconds=agree_seconds, step_times=step_times)
    add_parameters(driver, flats, track_norms)
    return driver


def add_parameters(driver: OuterStepDriver, flats: Iterable[FlatParameters], track_norms: bool) -> None:
    """The driver takes the optimizers' parameters, one flat view each, in order: their outer state starts at
    their current values; ``track_norms`` keeps the norms and peer distances in its reports."""
    driver.track_norms = track_norms
    for flat in flats:
        driver.add(flat)


def last_step(driver: OuterStepDriver, index: int, max_steps: int,
              loop_ends: Optional[Callable[[], bool]] = None) -> bool:
    """Whether training ends after this inner step of optimizer ``index`` (asked before the driver is told of
    it): by the driver's count against ``max_steps`` (-1: none) where the driver ends the run, or where the
    loop gives no ``loop_ends`` (a loop that ends at ``max_steps`` of every optimizer); else ``loop_ends()``
    says whether the training loop ends after this step (its own count: epochs, the last batch, a caller's
    word)."""
    if (driver.ends_by_driver_steps and max_steps >= 0) or loop_ends is None:
        return max_steps >= 0 and driver.last_step(index, max_steps)
    return loop_ends()


def stream_count(options: Options, backend: str, model_bytes: int) -> tuple[Union[int, str], int]:
    """The transport's ``streams`` and how many groups it spreads exchanges over (1: none made): an integer as
    given; ``"auto"`` on the strategies' own transport by the model's bytes, else 1 (rules ``streams-*``)."""
    streams = options.wire.streams
    if streams != AUTO_STREAMS:
        return streams, int(streams)
    import torch.distributed as dist

    own = options.elastic is None and options.transport_factory is None
    k = options.ranks_per_replica
    several = dist.is_initialized() and dist.get_world_size() // k > 1  # replicas to exchange with
    count = auto_stream_groups(model_bytes, backend, k) if own and several else 1
    return (AUTO_STREAMS, count) if count > 1 else (1, 1)


class ReplicaRun:
    """The transport, the driver and its plug-in of one replica during one training run.

    Args:
        options: the run's options.
        transport_factory: builds the transport (the mode's, or the strategy's ``transport_factory``).
        mode: the static launch or an elastic replica (:mod:`lightning_loco.replica.modes`).
        groups: this process's groups beyond the default one (replica, slice, overlap).
        layout: the replica's layout (whole or sharded).
        comm_device: where buffers cross the network.
        label: how warnings name this replica.
        clock: the driver's clock.
        check_stop: called while an elastic replica waits (may raise to stop it, e.g. on SIGTERM).
        model_bytes: the bytes of the whole payload (float32 parameters), from which ``streams="auto"`` makes
            its groups (:func:`~lightning_loco.transport.streams.auto_stream_groups`).
    """

    def __init__(self, options: Options, transport_factory: Callable[..., Transport], mode: RunMode,
                 groups: ProcessGroups, layout: Layout, comm_device: torch.device, label: str,
                 clock: Callable[[], float] = time.perf_counter,
                 check_stop: Callable[[str], None] = lambda waiting_for: None, model_bytes: int = 0) -> None:
        k = options.ranks_per_replica
        streams, count = stream_count(options, groups.backend, model_bytes)
        base = groups.overlap_group() if options.overlap_steps else None
        transport = transport_factory(
            device=comm_device, process_group=base, ranks_per_replica=k, replica_group=groups.replica,
            slice_group=groups.slice, **mode.transport_options(check_stop), **layout.transport_options(),
            # the strategies' own transport only (rules streams-*)
            **({"streams": streams, "stream_groups": groups.stream_groups(count, base)} if count > 1 else {}),
        )
        several = k > 1
        self.groups, self.layout, self.comm_device = groups, layout, comm_device
        self.step_times = step_times_of(transport.num_replicas) if options.sync_seconds == AUTO else None
        self.driver = replica_driver(
            options, transport, label=label, plugin=mode.plugin(transport), clock=clock, step_times=self.step_times,
            agree_overlap=self._agree_overlap if several else None,
            agree_seconds=self._agree_seconds if several else None,
        )

    def _agree_overlap(self, tau: int) -> int:
        """A replica's ranks agree (they land together; sharded, they hold one model between them): the
        largest τ."""
        return int(self.groups.replica_max(tau, self.comm_device))

    def _agree_seconds(self, seconds: float) -> float:
        """Under pacing a replica's ranks agree on their phase's seconds (the largest), so that they start
        rounds together and their schedules read the same nominal progress."""
        return self.groups.replica_max(seconds, self.comm_device)

    def start(self, optimizers: Sequence[torch.optim.Optimizer], resumed: Optional[list[dict[str, Any]]],
              training_state: Optional[TrainingState], max_steps: int, track_norms: bool = False) -> None:
        """Takes the optimizers' parameters (their outer state starts at their current values), a resumed
        outer state (``CheckpointError`` if it does not fit), the training state outside the driver that a
        healing elastic replica takes, and the run's ``max_steps`` (-1: none); then the plug-in's turn
        before the first inner step (an elastic replica's first membership)."""
        driver = self.driver
        add_parameters(driver, (self.layout.flat_parameters(params_of(optimizer)) for optimizer in optimizers),
                       track_norms)
        if resumed is not None:
            try:
                driver.load_state_dict(resumed)
            except ValueError as err:
                raise checkpoints.CheckpointError(str(err)) from err
        if training_state is not None:
            driver.plugin.use_training_state(training_state)
        if driver.pacing is not None:
            driver.pacing.end_at(max_steps)  # ⌈max_steps / H⌉ rounds, the same on every replica
        driver.before_training()

    def after_step(self, index: int, optimizer: torch.optim.Optimizer, max_steps: int,
                   loop_ends: Optional[Callable[[], bool]] = None, who: str = "") -> bool:
        """Counts one real inner step of optimizer ``index``; lands and starts rounds when they are due.
        Whether this step is the last of training is decided by :func:`last_step` (the driver's count or
        the loop's ``loop_ends``). Returns whether training must stop now because the driver ends the run
        (under pacing, the run ends on a round; a healed replica took the others' step count)."""
        driver = self.driver
        if index >= len(driver.optimizer_slots):
            raise RuntimeError(
                f"{who or 'The strategy'} has no outer state for this optimizer: optimizer steps must happen "
                "during training, on an optimizer the strategy was given."
            )
        if driver.round_due(index) and len(params_of(optimizer)) != len(driver.params_of(index)):
            raise RuntimeError(
                f"The parameters of optimizer {index} changed during training (e.g. add_param_group). "
                f"{who or 'The strategy'} keeps one outer state per optimizer over a fixed parameter list; "
                "give the optimizer all its parameters from the start (frozen ones included)."
            )
        by_driver = driver.ends_by_driver_steps and max_steps >= 0
        last = last_step(driver, index, max_steps, loop_ends)
        driver.after_inner_step(index, last=last)
        return by_driver and last

    def inner_steps(self, index: int = 0) -> int:
        """The inner steps optimizer ``index`` took (resumed ones included)."""
        return self.driver.optimizer_slots[index][0].inner_steps

    def outer_steps(self) -> int:
        """Rounds started by the first optimizer (by its first fragment), resumed ones included."""
        slots = self.driver.slots
        return slots[0].outer_steps if slots else 0

    def reached(self, max_steps: int) -> bool:
        """Whether every optimizer took ``max_steps`` inner steps (-1: no such end)."""
        return max_steps >= 0 and all(s[0].inner_steps >= max_steps for s in self.driver.optimizer_slots)

    def before_batch(self) -> None:
        """Rounds that landed as the last (``final_outer_step="average"``) before more training, from a
        resumed checkpoint or a guess for manual optimization: back to the outer step's weights."""
        self.driver.restore_outer_weights()

    def end(self) -> None:
        """Training ended: a round still in flight lands now, early (as the final round)."""
        self.driver.land_all()

    def close(self, abandon_timeout: float) -> list[threading.Thread]:
        """Training stopped, however: rounds in flight are dropped after up to ``abandon_timeout`` seconds and
        the plug-in lets go (an elastic replica leaves its membership). Returns the threads still waiting
        on an exchange, whose process group must outlive them."""
        lingering = self.driver.abandon_all(abandon_timeout)
        self.driver.close()
        return lingering
