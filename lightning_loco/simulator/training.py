"""N replicas of a real module trained in one process, with the strategies' own outer step."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_loco.codecs import DEFAULT_BLOCK_SIZE, ring_all_reduce_bytes, wire_format
from lightning_loco.driver import OuterStepDriver
from lightning_loco.flat import FlatParameters
from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.short_runs import warn_if_short
from lightning_loco.simulator.batched import BatchedGradients, BatchedStep
from lightning_loco.simulator.context import (
    ReplicaContext,
    check_precision,
    logging_discarded,
    parse_optimizers,
    training_step_loss,
    unattached_copy,
)
from lightning_loco.simulator.data import Batch, Shard
from lightning_loco.transport.in_process import InProcessNetwork

LossFn = Callable[[nn.Module, Batch], Tensor]
OptimizersFn = Callable[[nn.Module], Any]


@dataclass
class Evaluation:
    """Validation of the simulated replicas."""

    replica_losses: list[float]  # each replica's own weights
    consensus_loss: float  # the replicas' average weights

    @property
    def mean_replica_loss(self) -> float:
        return sum(self.replica_losses) / len(self.replica_losses)


class TrainingSimulator:
    """N replicas of a real module trained in one process, with the strategies' own outer step.

    Each replica has its own copy of the module, with a Lightning Trainer of its own attached (so its
    ``training_step`` can ``self.log``, see :mod:`lightning_loco.simulator.context`), its own inner
    optimizer and scheduler (built by ``optimizers`` on its copy, as ``configure_optimizers`` is on
    each rank), its own data shard and its own RNG stream. Every ``sync_every`` optimizer steps each
    replica's :class:`OuterStepDriver` runs the round over an :class:`InProcessNetwork`: the same
    driver, algorithm, schedule, payload, apply and group-order summation as the Lightning strategies,
    so a simulated run follows a multi-process run of the same seeds and shards step by step
    (``tests/test_simulator.py``).

    Args:
        module: the model; every replica starts from a copy of its current weights (as every rank
            starts from rank 0's).
        shards: one iterable of batches per replica (see :func:`distributed_shards`); re-iterated
            epoch after epoch, with ``sampler.set_epoch`` where the loader has one.
        algorithm: the outer step; ``None`` trains the replicas independently (or as DDP with
            ``gradient_averaging``).
        sync_every: H, optimizer steps between outer steps.
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
        wire_dtype, compression, compression_block_size, error_feedback: the wire format of the
            outer steps, as on the strategies (:mod:`lightning_loco.codecs`); ``bytes_sent`` counts the
            encoded bytes.
    """

    def __init__(
        self,
        module: nn.Module,
        shards: Sequence[Iterable[Batch]],
        algorithm: OuterAlgorithm | None = None,
        sync_every: int = 50,
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
        wire_dtype: str = "float32",
        compression: str | None = None,
        compression_block_size: int = DEFAULT_BLOCK_SIZE,
        error_feedback: bool | None = None,
    ) -> None:
        if not shards:
            raise ValueError("need one shard (an iterable of batches) per replica, got none")
        if batched not in (True, False, "auto"):
            raise ValueError(f"batched must be True, False or 'auto', got {batched!r}")
        if gradient_averaging and algorithm is not None:
            raise ValueError("gradient_averaging is DDP: pass algorithm=None with it")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (H) must be an integer >= 1, got {sync_every!r}")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"gradient_clip_val must be > 0 or None, got {gradient_clip_val}")
        if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int) \
                or accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be an integer >= 1, got {accumulate_grad_batches!r}")
        check_precision(precision)
        pseudo_gradient = algorithm.payload_is_pseudo_gradient if algorithm is not None else False
        wire = wire_format(wire_dtype, compression, compression_block_size, error_feedback, pseudo_gradient)
        self.wire = wire
        n = len(shards)
        self.num_replicas, self.algorithm, self.sync_every = n, algorithm, sync_every
        self.gradient_clip_val, self.gradient_averaging = gradient_clip_val, gradient_averaging
        self.accumulate_grad_batches, self.precision = accumulate_grad_batches, precision
        self.max_steps = max_steps
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
            for i, replica in enumerate(self.replicas):
                driver = OuterStepDriver(
                    algorithm, self.network.transport(i), sync_every, overlap_steps, overlap_merge,
                    label=f"Simulated replica {i}", final_outer_step=final_outer_step,
                    wire=wire if wire.lossy else None,
                )
                driver.track_norms = track_norms
                driver.add(self.flats[i])
                self.drivers.append(driver)
            self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="simulated-replica")
        self._batched_mode = batched
        self._batched: BatchedGradients | None = None
        self._batched_ran = False  # the batched path has run a step: its errors are errors from now on
        if batched is not False:
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
                      f"looping over replicas")

    def _loss(self, module: nn.Module, batch: Batch, batch_idx: int) -> Tensor:
        if self._custom_loss:
            return self.loss_fn(module, batch)
        return training_step_loss(module, batch, batch_idx)

    # ------------------------------------------------------------------ training

    def _loop_grads(self, draws: list[list[tuple[Batch, int, int]]]) -> list[float]:
        losses = []
        for i, (replica, drawn) in enumerate(zip(self.replicas, draws)):
            torch.set_rng_state(self.rng_states[i])
            for p in self.params[i]:
                p.grad = None
            total = 0.0
            for batch, batch_idx, epoch in drawn:
                with torch.enable_grad():
                    with self.contexts[i].training_step(batch, epoch):
                        loss = self._loss(replica, batch, batch_idx)
                    (loss / self.accumulate_grad_batches).backward()
                total += loss.item()
            losses.append(total / len(drawn))
            self.rng_states[i] = torch.get_rng_state()
        return losses

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
        for driver in self.drivers:  # a final landing, and training goes on after all
            driver.restore_outer_weights()
        last = last or (self.max_steps is not None and self.step_count + 1 == self.max_steps)
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
        self._after_inner_step(last)
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
            mean = torch.stack(grads).mean(0)  # type: ignore[arg-type]
            for p in per_param:
                p.grad = mean.clone()

    def _after_inner_step(self, last: bool) -> None:
        if not self.drivers:
            return
        slot = self.drivers[0].slots[0]
        busy = self.drivers[0].round_due(0) or slot.in_flight is not None
        if not busy:
            for driver in self.drivers:
                driver.after_inner_step(0, last)
            return
        # A round is due or in flight: replicas wait for their peers, so each runs in its own thread.
        for future in [self._pool.submit(driver.after_inner_step, 0, last) for driver in self.drivers]:
            future.result()

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
        for future in [self._pool.submit(driver.land_all) for driver in self.drivers]:
            future.result()
        self._pool.shutdown()

    # ------------------------------------------------------------------ measurements

    @property
    def logged(self) -> list[dict[str, float]]:
        """Per replica, the last value of everything its ``training_step`` logged with ``self.log`` or
        ``self.log_dict`` (its Trainer's ``callback_metrics``: ``name``, or ``name_step`` and
        ``name_epoch`` for values logged on both)."""
        return [context.logged for context in self.contexts]

    def weights(self) -> list[Tensor]:
        """Every replica's flat float32 weights (in its optimizer's parameter order)."""
        return [flat.gather() for flat in self.flats]

    def outer_weights(self) -> list[Tensor] | None:
        """After a final landing (``final_outer_step="average"``): the weights the papers' plain outer
        step gave each replica instead, which training that goes on starts from. Else ``None``."""
        kept = [d.slots[0].outer_weights for d in self.drivers]
        if not kept or any(w is None for w in kept):
            return None
        return [w.clone() for w in kept]  # type: ignore[union-attr]

    def spread(self) -> float:
        """RMS distance of the replicas' weights from their mean (the strategies' ``replica_spread``)."""
        w = torch.stack(self.weights())
        return (w - w.mean(0)).pow(2).sum(1).mean().sqrt().item()

    def bytes_sent(self) -> list[int]:
        """Payload bytes each replica has sent so far (DDP: a ring all-reduce of the gradients per
        step; independent replicas: none)."""
        if self.drivers:
            return [sum(r.bytes_sent for r in d.reports) for d in self.drivers]
        if self.gradient_averaging:
            n, numel = self.num_replicas, sum(p.numel() for p in self.params[0])
            return [ring_all_reduce_bytes(numel * 4, n) * self.step_count] * n
        return [0] * self.num_replicas

    def consensus_module(self) -> nn.Module:
        """A copy of the module holding the replicas' average weights."""
        return self._module_with(torch.stack(self.weights()).mean(0))

    def _module_with(self, flat: Tensor) -> nn.Module:
        module = copy.deepcopy(self._template)
        own = {id(p): name for name, p in self.replicas[0].named_parameters()}
        target = dict(module.named_parameters())
        FlatParameters([target[own[id(p)]] for p in self.params[0]], "cpu").scatter(flat)
        return module

    def _replica_copy(self, i: int) -> nn.Module:
        """Replica ``i``'s weights and buffers in a copy of the module: evaluation leaves the replica's
        own state (its metrics' accumulated values, what it logged) as training left it."""
        module = copy.deepcopy(self._template)
        module.load_state_dict(self.replicas[i].state_dict())
        return module

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[Batch],
        loss: LossFn | None = None,
        weights: Sequence[Tensor] | None = None,
        replicas: Sequence[int] | None = None,
    ) -> Evaluation:
        """Mean loss over ``batches`` of each replica and of the consensus (average of all replicas)
        model; of ``weights`` (flat, one per replica, e.g. :meth:`outer_weights`) instead of the live
        ones when given. ``replicas``: evaluate only these replicas (the consensus still averages all).
        The models are copies, and what their ``training_step`` logs (the default loss) is discarded:
        evaluating leaves training's state, logged values and metrics as they were."""
        loss_fn = loss or self.loss_fn
        batches = list(batches)
        chosen = list(range(self.num_replicas)) if replicas is None else list(replicas)
        if weights is None:
            models = [*(self._replica_copy(i) for i in chosen), self.consensus_module()]
        else:
            mean = torch.stack(list(weights)).mean(0)
            models = [*(self._module_with(weights[i]) for i in chosen), self._module_with(mean)]
        for i, model in zip([*chosen, 0], models):  # a training_step may read self.trainer
            self.contexts[i].attach(model)
        results = []
        with logging_discarded(models):
            for model in models:
                was_training = model.training
                model.eval()
                total = sum(float(loss_fn(model, b)) for b in batches)
                model.train(was_training)
                results.append(total / max(1, len(batches)))
        return Evaluation(replica_losses=results[:-1], consensus_loss=results[-1])
