"""N replicas of a real module trained in one process, with the strategies' own outer step."""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.algorithms.defaults import NOLOCO
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.driver.pacing import SharedStepTimes
from lightning_loco.replica.options import PacingConfig, WireConfig, pacing_config, wire_config
from lightning_loco.replica.run import last_step, replica_driver
from lightning_loco.replica.short_runs import warn_if_short
from lightning_loco.rules import Simulated, build_options
from lightning_loco.simulator.batched import BatchedGradients, BatchedStep
from lightning_loco.simulator.context import (
    ReplicaContext,
    check_precision,
    parse_optimizers,
    training_step_loss,
    unattached_copy,
)
from lightning_loco.simulator.data import Batch, Shard
from lightning_loco.simulator.measure import Evaluation, LossFn, Measurements
from lightning_loco.simulator.timing import ModelledTime, PacedRounds, check_modelled_time
from lightning_loco.transport.base import PeerError
from lightning_loco.transport.in_process import InProcessNetwork

__all__ = ["Evaluation", "TrainingSimulator"]

OptimizersFn = Callable[[nn.Module], Any]


class TrainingSimulator(Measurements, PacedRounds):
    """N replicas of a real module trained in one process, with the strategies' own outer step.

    Each replica has its own copy of the module, with a Lightning Trainer of its own attached (so its
    ``training_step`` can ``self.log``, see :mod:`lightning_loco.simulator.context`), its own inner
    optimizer and scheduler (built by ``optimizers`` on its copy, as ``configure_optimizers`` is on
    each rank), its own data shard and its own RNG stream. Every ``sync_every`` optimizer steps each
    replica's :class:`OuterStepDriver` runs the round over an :class:`InProcessNetwork`: the same
    driver, algorithm, schedule, payload, apply and group-order summation as the Lightning strategies,
    so a simulated run follows a multi-process run of the same seeds and shards step by step
    (``tests/test_simulator.py``).

    Replicas of different speeds: with ``step_seconds`` every replica runs on a virtual clock that
    moves by its modelled step time at each step and, at an exchange, to the time the last member of
    its group posted (:mod:`.timing`). With ``sync_seconds`` as well, each replica takes its own H_i
    steps per round on that clock, as the strategies do on a real one (``docs/heterogeneous.md``);
    :meth:`run_rounds` runs such rounds (:meth:`step` steps every replica together).

    Args:
        module: the model; every replica starts from a copy of its current weights (as every rank
            starts from rank 0's).
        shards: one iterable of batches per replica (see :func:`distributed_shards`); re-iterated
            epoch after epoch, with ``sampler.set_epoch`` where the loader has one.
        algorithm: the outer step; ``None`` trains the replicas independently (or as DDP with
            ``gradient_averaging``).
        sync_every: H, optimizer steps between outer steps (default: NoLoCo's paper H).
        optimizers: builds a replica's inner optimizer from its module copy; it may return what
            ``configure_optimizers`` returns (an optimizer, or a dict with a step-interval
            ``lr_scheduler``). Default: ``module.configure_optimizers``.
        loss: ``loss(module, batch) -> Tensor``. Default: ``module.training_step(batch, batch_idx)``.
        gradient_clip_val: clip each replica's gradient norm (Lightning's ``gradient_clip_val``).
        accumulate_grad_batches: k, as Lightning's: every optimizer step takes k batches, each loss
            divided by k (fewer at the end of an epoch); H and ``max_steps`` count optimizer steps.
        precision: "32-true" or "bf16-mixed" (the forward pass under bfloat16 autocast, float32
            weights and gradients, as Lightning's plugin).
        gradient_averaging: average the gradients over replicas at every step: DDP at the same global
            batch (needs ``algorithm=None``).
        overlap_steps, overlap_merge, final_outer_step: as on the strategies (the last default,
            "average", lands the round that ends training without the momentum extrapolation).
        max_steps: the run's length, when known: its last step is taken as the end of training (see
            ``final_outer_step``); ``step(last=True)`` does the same for any step.
        batched: ``True`` computes every replica's gradients in one ``torch.func.vmap`` call, ``False``
            loops over replicas, ``"auto"`` tries the batched path and falls back to the loop, with
            one warning naming the cause, on any error while setting it up or running its first step
            (BatchNorm's running statistics, a torchmetrics metric updated in ``training_step``, ...).
            The batched path draws dropout for all replicas from one generator (``randomness=
            "different"``); the loop keeps one RNG stream per replica, as separate processes do.
        track_norms: keep the outer-step norms and peer distances in the drivers' reports (and the
            compression error norm with a lossy wire format).
        wire: the wire format of the outer steps, as on the strategies (a format name or a
            :class:`~lightning_loco.replica.options.WireConfig`); ``bytes_sent`` counts the encoded bytes.
        step_seconds: each replica's modelled time per optimizer step (virtual seconds): its clock,
            the drivers' reports and ``sync_seconds`` follow it; :attr:`time` holds the clocks.
        pacing: as on the strategies (T = ``sync_seconds``, or a
            :class:`~lightning_loco.replica.options.PacingConfig` with its merge): each replica posts its next
            round once its inner phase is as near T modelled seconds as its steps allow (at least one
            step, at most H). Needs ``step_seconds``, ``max_steps`` (the run is ⌈max_steps / H⌉ rounds on
            every replica) and takes the loop over replicas (the batched path steps every replica
            together).
        fragments: F, streaming fragments, as on the strategies (``docs/fragments.md``): one of F
            fragments of the model (whole parameters) has a round every H/F steps. Needs an algorithm,
            and fixed H without ``step_seconds``.
    """

    def __init__(
        self,
        module: nn.Module,
        shards: Sequence[Iterable[Batch]],
        algorithm: OuterAlgorithm | None = None,
        sync_every: int = NOLOCO.sync_every,
        optimizers: OptimizersFn | None = None,
        loss: LossFn | None = None,
        gradient_clip_val: float | None = None,
        accumulate_grad_batches: int = 1,
        precision: str = "32-true",
        gradient_averaging: bool = False,
        overlap_steps: Any = 0,
        overlap_merge: str = "predict_correct",
        final_outer_step: str = "average",
        max_steps: int | None = None,
        batched: bool | str = "auto",
        track_norms: bool = True,
        wire: str | WireConfig = "float32",
        step_seconds: Sequence[float] | None = None,
        pacing: float | PacingConfig | None = None,
        fragments: int = 1,
    ) -> None:
        if not shards:
            raise ValueError("need one shard (an iterable of batches) per replica, got none")
        if batched not in (True, False, "auto"):
            raise ValueError(f"batched must be True, False or 'auto', got {batched!r}")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (H) must be an integer >= 1, got {sync_every!r}")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"gradient_clip_val must be > 0 or None, got {gradient_clip_val}")
        if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int) \
                or accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be an integer >= 1, got {accumulate_grad_batches!r}")
        check_precision(precision)
        paced = pacing_config(pacing)
        options = None
        if algorithm is not None:  # the strategies' options and their rules, the simulator's among them
            simulated = Simulated(gradient_averaging=bool(gradient_averaging), step_seconds=step_seconds is not None,
                                  max_steps=max_steps, batched=batched)
            options = build_options(algorithm, sync_every, loop="simulator", simulated=simulated,
                                    overlap_steps=overlap_steps, overlap_merge=overlap_merge, fragments=fragments,
                                    pacing=paced, final_outer_step=final_outer_step, wire=wire)
        else:
            given = [name for name, value, default in (
                ("overlap_steps", overlap_steps, 0), ("overlap_merge", overlap_merge, "predict_correct"),
                ("fragments", fragments, 1), ("pacing", paced, None), ("wire", wire_config(wire), WireConfig()),
            ) if value != default]
            if given:
                raise ValueError(f"{', '.join(given)} configure the outer step: give an algorithm with them "
                                 "(algorithm=None trains the replicas independently, or as DDP)")
        sync_seconds = None if paced is None else paced.sync_seconds
        check_modelled_time(algorithm, len(shards), step_seconds)
        self.options = options
        self.wire = options.wire_format if options is not None else WireConfig().resolve(False)
        n = len(shards)
        self.num_replicas, self.algorithm, self.sync_every = n, algorithm, sync_every
        self.gradient_clip_val, self.gradient_averaging = gradient_clip_val, gradient_averaging
        self.accumulate_grad_batches, self.precision = accumulate_grad_batches, precision
        self.max_steps, self.sync_seconds, self.fragments = max_steps, sync_seconds, fragments
        self.time = None if step_seconds is None else ModelledTime(step_seconds, algorithm)  # type: ignore[arg-type]
        warn_if_short(algorithm, max_steps, sync_every, warnings.warn)  # the strategies' warning, at fit's start
        self.loss_fn = loss or training_step_loss
        self._custom_loss = loss is not None
        self._template = unattached_copy(module)  # for the consensus model; never attached to a Trainer
        self.replicas = [copy.deepcopy(self._template) for _ in range(n)]
        self.contexts = [
            ReplicaContext(replica, precision, accumulate_grad_batches, gradient_clip_val, max_steps)
            for replica in self.replicas
        ]
        for replica in self.replicas:
            replica.train()
        make = optimizers or (lambda m: m.configure_optimizers())  # type: ignore[operator]
        parsed = [parse_optimizers(make(replica)) for replica in self.replicas]
        self.optimizers = [p[0] for p in parsed]
        self.schedulers = [p[1] for p in parsed]
        for context, (optimizer, scheduler) in zip(self.contexts, parsed):
            context.set_optimizer(optimizer, scheduler)
        self.params = [[p for g in opt.param_groups for p in g["params"]] for opt in self.optimizers]
        self.flats = [FlatParameters(params, "cpu") for params in self.params]  # each replica's weights as one vector
        self.shards = [Shard(s) for s in shards]
        self.rng_states = [torch.get_rng_state() for _ in range(n)]  # every rank seeded alike
        self.step_count = 0
        self.lr_history: list[float] = []  # replica 0's learning rate (first group) at each step
        self.network: InProcessNetwork | None = None
        self.drivers: list[OuterStepDriver] = []
        if algorithm is not None:
            self.network = InProcessNetwork(n, timeout=600.0)
            assert options is not None
            step_times = SharedStepTimes()  # sync_seconds="auto": the replicas' step times (the run's store's)
            for i in range(n):  # as ReplicaRun builds a replica's driver, over the in-process transport
                self.drivers.append(replica_driver(
                    options, self.network.transport(i), [self.flats[i]], label=f"Simulated replica {i}",
                    plugin=None if self.time is None else self.time.plugin(i),
                    clock=time.perf_counter if self.time is None else self.time.clocks[i],
                    step_times=step_times, track_norms=track_norms,
                ))
            self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="simulated-replica")
        self._batched_mode = batched
        self._batched: BatchedGradients | None = None
        self._batched_ran = False  # the batched path has run a step: its errors are errors from now on
        if batched is not False and sync_seconds is None:
            try:
                self._batched = BatchedGradients(self.replicas, self._template, self._loss, self.contexts[0],
                                                 accumulate_grad_batches)
            except Exception as err:
                self._fall_back(err)

    @property
    def batched(self) -> bool:
        """Whether steps take the batched (``vmap``) path."""
        return self._batched is not None

    def _fall_back(self, err: Exception) -> None:
        if self._batched_mode is True:
            raise err
        self._batched = None
        warnings.warn(f"TrainingSimulator: the batched path is not available ({type(err).__name__}: {err}); "
                      f"looping over replicas", stacklevel=3)

    def _loss(self, module: nn.Module, batch: Batch, batch_idx: int) -> Tensor:
        if self._custom_loss:
            return self.loss_fn(module, batch)
        return training_step_loss(module, batch, batch_idx)

    # ------------------------------------------------------------------ training

    def _loop_grads(self, draws: list[list[tuple[Batch, int, int]]]) -> list[float]:
        return [self._replica_grads(i, drawn) for i, drawn in enumerate(draws)]

    def _replica_grads(self, i: int, drawn: list[tuple[Batch, int, int]]) -> float:
        """Replica ``i``'s gradients over its micro-batches, on its own RNG stream; its mean loss."""
        torch.set_rng_state(self.rng_states[i])
        for p in self.params[i]:
            p.grad = None
        total = 0.0
        for batch, batch_idx, epoch in drawn:
            with torch.enable_grad():
                with self.contexts[i].training_step(batch, epoch):
                    loss = self._loss(self.replicas[i], batch, batch_idx)
                (loss / self.accumulate_grad_batches).backward()
            total += loss.item()
        self.rng_states[i] = torch.get_rng_state()
        return total / len(drawn)

    def _batched_grads(self, draws: list[list[tuple[Batch, int, int]]]) -> list[float] | None:
        """The batched path's step, ``None`` where the loop takes it (this step, or from now on after
        the first step failed under ``batched="auto"``)."""
        assert self._batched is not None
        try:
            step: BatchedStep | None = self._batched.compute(draws)
        except Exception as err:
            if self._batched_ran:
                raise
            self._fall_back(err)  # nothing was set: the loop takes the same batches
            return None
        if step is None:
            return None
        self._batched_ran = True
        for j, per_replica in enumerate(step.logged):
            for i, context in enumerate(self.contexts):
                batch, _, epoch = draws[i][j]
                context.replay(batch, epoch, per_replica[i])
        return step.losses

    def step(self, last: bool = False) -> list[float]:
        """One optimizer step on every replica (``accumulate_grad_batches`` batches each) and the outer
        step where one is due. ``last``: training ends after this step (as the step reaching
        ``max_steps``), so a round landing now is the final one; training may still go on after it,
        from the outer step's own weights. Returns each replica's mean training loss over its batches."""
        if self.sync_seconds is not None:
            raise ValueError("under sync_seconds every replica takes its own steps per round: call run_rounds()")
        for driver in self.drivers:  # a final landing, and training goes on after all
            driver.restore_outer_weights()
        ends = last or (self.max_steps is not None and self.step_count + 1 == self.max_steps)  # the loop's count
        draws = [shard.draw(self.accumulate_grad_batches) for shard in self.shards]
        losses = self._batched_grads(draws) if self._batched is not None else None
        if losses is None:
            losses = self._loop_grads(draws)
        if self.gradient_averaging:
            self._average_gradients()
        self.lr_history.append(float(self.optimizers[0].param_groups[0]["lr"]))
        for i in range(self.num_replicas):
            if self.gradient_clip_val is not None:
                torch.nn.utils.clip_grad_norm_(self.params[i], self.gradient_clip_val)
            self.optimizers[i].step()
            self.contexts[i].optimizer_stepped()
            if self.time is not None:
                self.time.stepped(i)
        self._after_inner_step(ends)
        for scheduler in self.schedulers:
            if scheduler is not None:
                scheduler.step()
        for shard, context in zip(self.shards, self.contexts):
            if shard.at_epoch_end:
                context.end_epoch()
        self.step_count += 1
        return losses

    def _average_gradients(self) -> None:
        for per_param in zip(*self.params):
            grads = [p.grad for p in per_param]
            if any(g is None for g in grads):
                continue
            mean = torch.stack(grads).mean(0)
            for p in per_param:
                p.grad = mean.clone()

    def _after_inner_step(self, loop_ends: bool) -> None:
        """Every replica's driver is told of the step; whether it is the last is each replica's
        :func:`~lightning_loco.replica.run.last_step`, as on the strategies, the simulator's loop saying
        ``loop_ends``."""
        if not self.drivers:
            return
        max_steps = -1 if self.max_steps is None else self.max_steps
        last = [last_step(driver, 0, max_steps, lambda: loop_ends) for driver in self.drivers]
        driver = self.drivers[0]
        busy = driver.round_due(0) or any(slot.in_flight is not None for slot in driver.slots)
        busy = busy or (last[0] and self.fragments > 1)  # the end starts a round of every fragment
        if not busy:
            for driver, end in zip(self.drivers, last):
                driver.after_inner_step(0, end)
            return
        # A round is due or in flight: replicas wait for their peers, so each runs in its own thread.
        self._exchange(last)

    def _exchange(self, last: list[bool]) -> None:
        """Every replica's ``after_inner_step`` for a step that starts (or lands) a round, each in its own
        thread, as the replicas wait for their groups."""
        if self.time is not None:
            self.time.arrive()
        self._in_threads([partial(d.after_inner_step, 0, end) for d, end in zip(self.drivers, last)])

    def _in_threads(self, calls: list[Callable[[], Any]]) -> None:
        """Replica i's ``calls[i]``, each in its own thread. A replica whose call raises stops on the wire at
        once, so that its peers' waits for it fail now instead of at the network's timeout; the first
        error is raised."""
        assert self.network is not None
        futures = {self._pool.submit(call): i for i, call in enumerate(calls)}
        pending = set(futures)
        errors: list[BaseException] = []
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                error = future.exception()
                if error is not None:
                    self.network.fail(futures[future])
                    errors.append(error)
        if errors:  # the cause, not a peer's error about it
            raise next((e for e in errors if not isinstance(e, PeerError)), errors[0])

    def run(self, steps: int, every: int = 0, callback: Callable[[TrainingSimulator], None] | None = None) -> None:
        """``steps`` optimizer steps; ``callback(self)`` after every ``every``-th one (0: never)."""
        for _ in range(steps):
            self.step()
            if every and callback is not None and self.step_count % every == 0:
                callback(self)

    def finish(self) -> None:
        """The end of training: ends the replicas' logging epoch (``on_epoch=True`` values), lands
        rounds still in flight and stops the replicas' threads."""
        for context in self.contexts:
            context.end_epoch()
        if not self.drivers:
            return
        self._in_threads([driver.land_all for driver in self.drivers])
        self._pool.shutdown()
