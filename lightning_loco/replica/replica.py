"""One replica of a low-communication run, as any training loop's strategy drives it: no Lightning here.

:class:`Replica` is built from the run's :class:`~lightning_loco.replica.options.Options` and the strategy that
hosts it (its :class:`Adapter`: ranks, devices, the model and the collectives of its loop). It owns what both
the Trainer's strategies (:mod:`lightning_loco.trainer`) and the Fabric strategies (:mod:`lightning_loco.fabric`)
do alike, so that they only translate their loops' hooks to it:

* the run mode (static or elastic, :mod:`.modes`) and the transport factory it gives;
* the layout of the model over the replica's ranks, whole or FSDP2-sharded (:mod:`.layout`), which reads the
  replica for its ranks, devices and model;
* the process groups (:mod:`.process_groups`), from the launch to the end of training;
* the run of rounds (:class:`~lightning_loco.replica.run.ReplicaRun`) during training, and whether an
  optimizer step is the last (:meth:`ReplicaRun.after_step`);
* the one save and load of the replica payloads: every replica's own file and the consensus main file
  (:mod:`.checkpoints` holds the file format);
* the consensus (:mod:`.consensus`): the average, its state dict, its spread;
* the launch- and fit-time rules (:mod:`lightning_loco.rules`), over the facts its adapter gathers
  (:meth:`Replica.check_launch`, :meth:`Replica.check_fit`), so that both loops check them alike.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol

import torch

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.driver.plugins import TrainingState
from lightning_loco.replica import checkpoints, consensus
from lightning_loco.replica.layout import ReplicaLayout, replica_layout
from lightning_loco.replica.modes import TransportFactory, run_mode
from lightning_loco.replica.options import Options
from lightning_loco.replica.process_groups import ProcessGroups
from lightning_loco.replica.run import ReplicaRun
from lightning_loco.rules import Facts, Fit, Launch, check_rules
from lightning_loco.rules.table import Loop


class Adapter(Protocol):
    """The training loop's strategy, as its replica sees it."""

    @property
    def replica_module(self) -> Optional[Any]:
        """The model this replica trains, unwrapped (None before the loop gave it one)."""

    @property
    def root_device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    def comm_device(self) -> torch.device: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: Optional[str] = None) -> None: ...


class Replica:
    """One replica: its mode, layout, process groups, run, checkpoints and consensus (see the module docstring).

    Args:
        options: the run's options (their build rules already checked by the strategy).
        adapter: the strategy hosting the replica.
        loop: whose training loop drives it, as the rules know it: the Trainer's, or a Fabric loop (which calls
            the module itself, as the FSDP2 layout's automatic policy must know).
    """

    _abandon_timeout_s: float = 10.0  # how long a stopped run waits for a round in flight before dropping it

    def __init__(self, options: Options, adapter: Adapter, loop: Loop = "trainer") -> None:
        self.options = options
        self.adapter = adapter
        self.loop: Loop = loop
        self.mode = run_mode(options.elastic)
        self.layout: ReplicaLayout = replica_layout(self, options.replica_sharding, root_is_called=loop == "fabric")
        self.transport_factory: TransportFactory = self.mode.transport_factory(options.transport_factory)
        self.groups: Optional[ProcessGroups] = None  # from the launch to the end of training
        self.run: Optional[ReplicaRun] = None  # during training
        self.resumed_outer: Optional[list[dict[str, Any]]] = None  # from a loaded checkpoint, until training starts
        self.averaged_at_end = False  # training ended on the replicas' average (average_at_end): saves record it
        # what a checkpoint loaded for training left in the replicas, until training starts: "own" weights, or the
        # average taken at the end of the run that saved it ("averaged"); None: nothing loaded
        self.loaded: Optional[str] = None
        self.tracks_norms = False  # reports keep norms and peer distance (see track_norms)
        self._clock: Callable[[], float] = time.perf_counter  # the driver's clock (tests inject a virtual one)
        self._final_outer_steps = 0  # the rounds the last run started, once it is closed

    # ------------------------------------------------------------------ what the layout and the strategies read

    @property
    def algorithm(self) -> OuterAlgorithm:
        return self.options.algorithm

    @property
    def ranks_per_replica(self) -> int:
        return self.options.ranks_per_replica

    @property
    def num_replicas(self) -> int:
        return self.adapter.world_size // self.ranks_per_replica

    @property
    def replica_index(self) -> int:
        return self.adapter.global_rank // self.ranks_per_replica

    @property
    def module(self) -> Any:
        return self.adapter.replica_module

    @property
    def root_device(self) -> torch.device:
        return self.adapter.root_device

    @property
    def global_rank(self) -> int:
        return self.adapter.global_rank

    @property
    def is_global_zero(self) -> bool:
        return self.adapter.is_global_zero

    @property
    def outer_state_device(self) -> torch.device:
        device = self.options.outer_state_device
        return device if device is not None else self.adapter.root_device

    def comm_device(self) -> torch.device:
        return self.adapter.comm_device()

    @property
    def driver(self) -> Any:
        """The run's :class:`~lightning_loco.driver.driver.OuterStepDriver` during training (None otherwise)."""
        return self.run.driver if self.run is not None else None

    @property
    def outer_steps(self) -> int:
        """Rounds started by the first optimizer (by its first fragment), resumed ones included; after training,
        the count it ended with (0 before training)."""
        slots = self.driver.slots if self.driver is not None else []
        return slots[0].outer_steps if slots else self._final_outer_steps

    @property
    def nominal_step(self) -> Optional[float]:
        """With ``pacing``, the run's progress in nominal inner steps during training (None otherwise)."""
        if self.driver is None or self.driver.pacing is None:
            return None
        return self.driver.nominal_step()

    def track_norms(self) -> None:
        """From the next training on, every outer step's report keeps the norms of the outer gradient and update
        and the distance to the peers (one copy of the anchor per outer step): what ``OuterStepMonitor`` logs, and
        asks for at its setup."""
        self.tracks_norms = True

    # ------------------------------------------------------------------ the rules, over the adapter's facts

    def check_launch(self, launch: Launch) -> None:
        """The ``launch`` rules, once the processes are known and before any starts
        (:class:`~lightning_loco.rules.RefusedOptions`)."""
        check_rules("launch", Facts(self.options, launch=launch, loop=self.loop))

    def check_fit(self, fit: Fit) -> None:
        """The ``fit`` rules, once the model and its optimizers are known, before training starts."""
        check_rules("fit", Facts(self.options, fit=fit, loop=self.loop))

    # ------------------------------------------------------------------ launch, training, end

    def setup_distributed(self, backend: str, timeout: Optional[timedelta]) -> None:
        """Once the default process group exists: the replica's own groups (with the mode's timeout) and the
        layout's."""
        timeout = self.mode.replica_timeout(timeout)
        self.groups = ProcessGroups(self.ranks_per_replica, backend, timeout)
        self.groups.create_replica_groups()
        self.layout.setup_distributed(backend, timeout)

    def start(self, optimizers: Sequence[torch.optim.Optimizer], training_state: Optional[TrainingState],
              max_steps: int, *, check_stop: Optional[Callable[[str], None]] = None) -> ReplicaRun:
        """Training starts: the run of rounds over ``optimizers``, from a resumed outer state if a checkpoint
        was loaded (see :meth:`ReplicaRun.start`)."""
        assert self.groups is not None, "the replica's process groups are created at launch"
        stop = {} if check_stop is None else {"check_stop": check_stop}
        model_bytes = 4 * sum(p.numel() for o in optimizers for g in o.param_groups for p in g["params"])
        self.run = ReplicaRun(self.options, self.transport_factory, self.mode, self.groups, self.layout,
                              self.comm_device(), label=f"Replica {self.replica_index}", clock=self._clock,
                              model_bytes=model_bytes, **stop)
        self.run.start(optimizers, self.resumed_outer, training_state, max_steps, self.tracks_norms)
        self.resumed_outer, self.loaded, self.averaged_at_end = None, None, False
        return self.run

    def end_without_steps(self) -> None:
        """Training that resumed from a checkpoint ended before its first step (the checkpoint was taken at the
        run's end): it ends as that run ended, so that the resume is a no-op. With ``average_at_end`` every replica
        takes the replicas' average (one all-reduce) of the weights restored, as the run did of the same weights,
        unless the checkpoint was saved after that average: its replicas hold it already. Collective."""
        loaded, self.loaded = self.loaded, None
        if loaded == "own" and self.options.averages_at_end:
            self.average()
            self.averaged_at_end = True

    def end(self) -> None:
        """Training ended: a round still in flight lands now, early (as the final round)."""
        if self.run is not None:
            self.run.end()

    def average_at_end(self) -> None:
        """With ``average_at_end`` (None: unless elastic), every replica takes the replicas' average once training
        ended, and later saves record it. Collective."""
        if self.options.averages_at_end and self.module is not None:
            self.average()
            self.averaged_at_end = True

    def close(self) -> None:
        """Training stopped, however: the run lets go (rounds in flight dropped after up to ten seconds) and
        the process groups are destroyed once the threads still exchanging are done with them; the rounds it
        started are kept (:attr:`outer_steps`)."""
        if self.run is not None:
            self._final_outer_steps = self.outer_steps
        lingering = self.run.close(self._abandon_timeout_s) if self.run is not None else []
        self.run, self.resumed_outer = None, None
        if self.groups is not None:
            self.groups.destroy(lingering)
            self.groups = None

    # ------------------------------------------------------------------ the consensus (global collectives)

    def average(self) -> None:
        """Sets every replica to the replicas' average: parameters and floating-point buffers, one all-reduce
        (two with sharded replicas). Collective."""
        for tensors, group in self.layout.consensus_parts():
            consensus.average_into(tensors, self.comm_device(), group)
        self.layout.weights_changed()

    def consensus_state_dict(self, state: dict[str, Any]) -> Optional[dict[str, Any]]:
        """``state`` (a module's state dict) with its floating-point entries averaged over the replicas, as full
        tensors (sharded replicas: on global rank 0 only, None elsewhere). Collective."""
        return self.layout.checkpoint_consensus(state)

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Swaps the replicas' average into the model, and this replica's own weights back afterwards (exactly,
        whatever the dtype). Collective."""
        device, keep_on = self.comm_device(), self.outer_state_device
        try:
            with ExitStack() as stack:
                for tensors, group in self.layout.consensus_parts():
                    stack.enter_context(consensus.swapped_in(tensors, device, keep_on, group))
                self.layout.weights_changed()
                yield
        finally:
            self.layout.weights_changed()

    def spread(self) -> float:
        """RMS distance of the replicas' parameters from their mean (two all-reduces). Collective."""
        return self.layout.replica_spread()

    # ------------------------------------------------------------------ checkpoints (collective)

    def save(self, path: Any, contents: Mapping[str, Any], main_consensus: Callable[[], Any],
             write_main: Callable[[Any, dict[str, Any]], None], step: Optional[Mapping[str, Any]] = None,
             extra: Optional[Mapping[str, Any]] = None, agreed: Any = None) -> Any:
        """Writes every replica's own file, then the main file on global rank 0. Collective.

        The save's name is global rank 0's ``path``, whatever each rank passes (a file-name template may hold a
        metric that differs between replicas): every replica's file lands in the folder of the main file that
        rank 0 writes. That name, the save id and ``agreed`` travel in the one broadcast the save makes; rank
        0's ``agreed`` is returned on every rank. The manifest marks the save complete only once rank 0 has
        found every replica file in its folder; a save that cannot complete removes its folder and raises
        :class:`~lightning_loco.replica.checkpoints.CheckpointError` (on the ranks that saw it fail).

        Args:
            path: the main file.
            contents: what the replica file keeps of the loop's state (its ``state_dict``, and where there are
                any, ``optimizer_states`` and ``lr_schedulers``).
            main_consensus: computes the main file's consensus (a collective, before the outer state is read:
                reading it lands a round in flight).
            write_main: writes the main file, given the consensus and the save's metadata (global rank 0 only).
            step: the ``global_step`` (and ``epoch``) the save's manifest records (None: this replica's count
                of inner steps).
            extra: more entries of the replica file (e.g. a paced replica's own loops' progress).
            agreed: what else rank 0 decides for the save (e.g. its checkpoint callbacks' state).
        """
        driver = self.driver
        if driver is not None:
            driver.plugin.check_savable()  # e.g. an elastic heal into the outer state stopped part way
        save_id, path, agreed = self.adapter.broadcast((uuid.uuid4().hex[:12], path, agreed))
        averaged = main_consensus()
        outer = driver.state_dict() if driver is not None else []  # completes a round in flight
        name, index, count = self.algorithm.name, self.replica_index, self.num_replicas
        replica = checkpoints.replica_payload(contents, save_id, index, count, name, outer)
        replica.update(extra or {})
        if self.averaged_at_end:
            replica["averaged_at_end"] = True  # a resume that takes no step must not average again
        sidecar_dir = checkpoints.sidecar_dir(path, save_id)
        mine, shard = self.layout.replica_file(replica)
        failed: Optional[Exception] = None
        try:
            if mine is not None:  # whole replicas: one file per replica, by its first rank; sharded: every rank's
                checkpoints.write_replica(sidecar_dir, index, mine, shard)
        except Exception as err:  # the others still meet at the barrier, and rank 0 finds the file missing
            failed = err
        self.adapter.barrier("lightning_loco.save_checkpoint")  # every replica file exists before the main file
        meta = checkpoints.main_meta(path, save_id, name, count, shards=self.layout.shards())
        if self.is_global_zero:
            _complete_or_removed(path, meta, sidecar_dir, raises=failed is None)
        if failed is not None:
            raise checkpoints.CheckpointError(
                f"Replica {index} could not write its file of the checkpoint {path} ({type(failed).__name__}: "
                f"{failed}); the save is incomplete and its folder {sidecar_dir} is removed.") from failed
        if self.is_global_zero:
            if step is None:
                step = {"global_step": self.run.inner_steps() if self.run is not None else -1}
            checkpoints.write_manifest(sidecar_dir, path, step, meta)  # the save is complete
            write_main(averaged, meta)
            checkpoints.remove_sidecars(path, keep=sidecar_dir)
        return agreed

    def load(self, checkpoint: Mapping[str, Any], path: Any, resume: bool = True) -> Optional[dict[str, Any]]:
        """This replica's own file of the loaded main file ``checkpoint`` (None: every replica starts from the
        main file's consensus: a plain checkpoint, or another number of replicas). With ``resume`` its outer state
        is taken up when training starts. Collective: the ranks agree on any error."""
        payload = checkpoints.read_own_replica(checkpoint, path, self.replica_index, self.num_replicas,
                                               self.algorithm.name, agree=consensus.first_error,
                                               **self.layout.replica_shard())
        self.resumed_outer = payload["outer"] if payload is not None and resume else None
        if resume:
            self.loaded = None if payload is None else "averaged" if payload.get("averaged_at_end") else "own"
        return payload


def _complete_or_removed(path: Any, meta: Mapping[str, Any], sidecar_dir: str, raises: bool = True) -> None:
    """Checks that the save's folder holds every replica file; if not, removes that folder (no other save's)
    and (with ``raises``) raises :class:`~lightning_loco.replica.checkpoints.CheckpointError` saying so."""
    try:
        checkpoints.check_replica_files(path, meta)
    except checkpoints.CheckpointError as err:
        fs, folder = checkpoints.storage(sidecar_dir)
        try:
            fs.rm(folder, recursive=True)
        except OSError:
            pass  # nothing was written there
        if not raises:
            return
        raise checkpoints.CheckpointError(
            f"The save of {path} could not complete and was not marked complete; its replica folder "
            f"{sidecar_dir} is removed and no main file was written. {err}") from None
