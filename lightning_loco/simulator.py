"""N replicas of a real module trained in one process, with the strategies' own outer step.

It runs the very code the strategies run (the driver with its ``schedule``, ``payload``, ``apply``
and the same group-order summation as the transport); only the network is replaced.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.codecs import DEFAULT_BLOCK_SIZE, wire_format
from lightning_loco.driver import OuterStepDriver
from lightning_loco.flat import FlatParameters
from lightning_loco.transport.in_process import InProcessNetwork


Batch = Any
LossFn = Callable[[nn.Module, Batch], Tensor]
OptimizersFn = Callable[[nn.Module], Any]


def training_step_loss(module: nn.Module, batch: Batch) -> Tensor:
    """The default loss: ``module.training_step(batch, 0)`` (its loss, or the ``"loss"`` entry of the
    dict it returns)."""
    out = module.training_step(batch, 0)  # type: ignore[operator]
    return out["loss"] if isinstance(out, dict) else out


def distributed_shards(
    dataset: Dataset, num_replicas: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False
) -> list[DataLoader]:
    """Replica ``i``'s batches exactly as Lightning gives them to replica ``i`` of a strategy with
    ``num_replicas`` replicas: a ``DistributedSampler`` with that rank, the run's seed, and the epoch
    set at each pass (the simulator calls ``set_epoch``)."""
    return [
        DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=DistributedSampler(dataset, num_replicas, i, shuffle=shuffle, seed=seed, drop_last=drop_last),
        )
        for i in range(num_replicas)
    ]


class _Shard:
    """Endless batches of one replica's shard, one epoch after another."""

    def __init__(self, source: Iterable[Batch]) -> None:
        self.source, self.epoch, self._it = source, 0, None

    def next(self) -> Batch:
        while True:
            if self._it is None:
                sampler = getattr(self.source, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self.epoch)
                self._it = iter(self.source)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1


def _parse_optimizers(config: Any) -> tuple[Optimizer, Any]:
    """(optimizer, step-interval scheduler or None) from what ``configure_optimizers`` may return."""
    scheduler = None
    if isinstance(config, (list, tuple)) and len(config) == 2 and isinstance(config[0], (list, tuple)):
        optimizers, schedulers = config
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise ValueError("the simulator trains one optimizer (and at most one scheduler) per replica")
        config = {"optimizer": optimizers[0], "lr_scheduler": schedulers[0] if schedulers else None}
    if isinstance(config, (list, tuple)):
        if len(config) != 1:
            raise ValueError("the simulator trains one optimizer per replica")
        config = config[0]
    if isinstance(config, dict):
        optimizer, scheduler = config["optimizer"], config.get("lr_scheduler")
    else:
        optimizer = config
    if isinstance(scheduler, dict):
        if scheduler.get("interval", "epoch") != "step":
            raise ValueError("the simulator steps learning-rate schedulers per optimizer step: use interval='step'")
        scheduler = scheduler["scheduler"]
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"expected a torch optimizer from the optimizers function, got {type(optimizer).__name__}")
    return optimizer, scheduler


class _LossModule(nn.Module):
    """``loss(inner, batch)`` as a module, so that ``functional_call`` can swap the inner weights."""

    def __init__(self, inner: nn.Module, loss: LossFn) -> None:
        super().__init__()
        self.inner, self.loss = inner, loss

    def forward(self, batch: Batch) -> Tensor:
        return self.loss(self.inner, batch)


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

    Each replica has its own copy of the module, its own inner optimizer and scheduler (built by
    ``optimizers`` on its copy, as ``configure_optimizers`` is on each rank), its own data shard and
    its own RNG stream. Every ``sync_every`` inner steps each replica's :class:`OuterStepDriver` runs
    the round over an :class:`InProcessNetwork`: the same driver, algorithm, schedule, payload, apply
    and group-order summation as the Lightning strategies, so a simulated run follows a
    multi-process run of the same seeds and shards step by step (``tests/test_simulator.py``).

    Args:
        module: the model; every replica starts from a copy of its current weights (as every rank
            starts from rank 0's).
        shards: one iterable of batches per replica (see :func:`distributed_shards`); re-iterated
            epoch after epoch, with ``sampler.set_epoch`` where the loader has one.
        algorithm: the outer step; ``None`` trains the replicas independently (or as DDP with
            ``gradient_averaging``).
        sync_every: H, inner steps between outer steps.
        optimizers: builds a replica's inner optimizer from its module copy; it may return what
            ``configure_optimizers`` returns (an optimizer, or a dict with a step-interval
            ``lr_scheduler``). Default: ``module.configure_optimizers``.
        loss: ``loss(module, batch) -> Tensor``. Default: ``module.training_step(batch, 0)``.
        gradient_clip_val: clip each replica's gradient norm (Lightning's ``gradient_clip_val``).
        gradient_averaging: average the gradients over replicas at every step: DDP at the same global
            batch (needs ``algorithm=None``).
        overlap_steps, overlap_merge, final_outer_step: as on the strategies (the last default,
            "average", lands the round that ends training without the momentum extrapolation).
        max_steps: the run's length, when known: its last step is taken as the end of training (see
            ``final_outer_step``); ``step(last=True)`` does the same for any step.
        batched: ``True`` computes every replica's gradients in one ``torch.func.vmap`` call, ``False``
            loops over replicas, ``"auto"`` tries the batched path and falls back to the loop (with a
            warning) where the module does not allow it (e.g. BatchNorm's running statistics).
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
        pseudo_gradient = algorithm.payload_is_pseudo_gradient if algorithm is not None else False
        wire = wire_format(wire_dtype, compression, compression_block_size, error_feedback, pseudo_gradient)
        self.wire = wire
        n = len(shards)
        self.num_replicas, self.algorithm, self.sync_every = n, algorithm, sync_every
        self.gradient_clip_val, self.gradient_averaging = gradient_clip_val, gradient_averaging
        self.max_steps = max_steps
        self.loss_fn = loss or training_step_loss
        self._template = copy.deepcopy(module)  # for the consensus model
        self.replicas = [copy.deepcopy(module) for _ in range(n)]
        for replica in self.replicas:
            replica.train()
        make = optimizers or (lambda m: m.configure_optimizers())  # type: ignore[operator]
        parsed = [_parse_optimizers(make(replica)) for replica in self.replicas]
        self.optimizers = [p[0] for p in parsed]
        self.schedulers = [p[1] for p in parsed]
        self.params = [[p for g in opt.param_groups for p in g["params"]] for opt in self.optimizers]
        self.flats = [FlatParameters(params, "cpu") for params in self.params]  # each replica's weights as one vector
        self.shards = [_Shard(s) for s in shards]
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
        self._names: list[str] = []
        self._stacked: dict[str, Tensor] = {}
        self._grad_fn: Callable[..., Any] | None = None
        self.batched = False
        if batched is not False:
            try:
                self._setup_batched()
                self.batched = True
            except Exception as err:
                if batched is True:
                    raise
                warnings.warn(f"TrainingSimulator: the batched path is not available ({err}); looping over replicas")

    # ------------------------------------------------------------------ the batched path

    def _setup_batched(self) -> None:
        """Stacks every replica's parameters into one [N, ...] tensor per name; each replica's
        parameters become views into it, so the optimizers and the drivers see them as before."""
        from torch.func import functional_call, grad, vmap

        first = self.replicas[0]
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in first.modules()):
            raise ValueError("BatchNorm running statistics are updated in place")
        self._names = [name for name, _ in first.named_parameters()]
        template = _LossModule(copy.deepcopy(first), self.loss_fn)
        for name in self._names:
            stacked = torch.stack([r.get_parameter(name).detach() for r in self.replicas])
            self._stacked[name] = stacked
            for i, r in enumerate(self.replicas):
                r.get_parameter(name).data = stacked[i]
        buffers = {f"inner.{k}": v for k, v in first.named_buffers()}

        def loss_of(params: dict[str, Tensor], batch: Batch) -> Tensor:
            weights = {f"inner.{k}": v for k, v in params.items()}
            return functional_call(template, {**weights, **buffers}, (batch,))

        self._grad_fn = vmap(grad(loss_of, has_aux=False), randomness="different")

    def _batched_grads(self, batches: list[Batch]) -> bool:
        try:
            stacked_batch = tree_map(lambda *xs: torch.stack(xs), *batches)
        except (RuntimeError, TypeError):
            return False  # batches of different shapes (a last partial batch): loop this step
        assert self._grad_fn is not None
        with warnings.catch_warnings():
            # PyTorch warns once that some ops (CPU flash attention) have no batching rule and loop
            # over the replicas instead: correct, only slower (docs/simulator.md says so)
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
            grads = self._grad_fn({k: self._stacked[k] for k in self._names}, stacked_batch)
        for i, r in enumerate(self.replicas):
            for name in self._names:
                r.get_parameter(name).grad = grads[name][i]
        return True

    # ------------------------------------------------------------------ training

    def _loop_grads(self, batches: list[Batch]) -> list[float]:
        losses = []
        for i, (replica, batch) in enumerate(zip(self.replicas, batches)):
            torch.set_rng_state(self.rng_states[i])
            for p in self.params[i]:
                p.grad = None
            with torch.enable_grad():
                loss = self.loss_fn(replica, batch)
                loss.backward()
            losses.append(loss.item())
            self.rng_states[i] = torch.get_rng_state()
        return losses

    def step(self, last: bool = False) -> list[float]:
        """One inner step on every replica (and the outer step where one is due). ``last``: training
        ends after this step (as the step reaching ``max_steps``), so a round landing now is the final
        one; training may still go on after it, from the outer step's own weights. Returns the
        replicas' training losses (from the batched path: ``nan``, the losses are not kept)."""
        for driver in self.drivers:  # a final landing, and training goes on after all
            driver.restore_outer_weights()
        last = last or (self.max_steps is not None and self.step_count + 1 == self.max_steps)
        batches = [shard.next() for shard in self.shards]
        if self.batched and self._batched_grads(batches):
            losses = [float("nan")] * self.num_replicas
        else:
            losses = self._loop_grads(batches)
        if self.gradient_averaging:
            self._average_gradients()
        self.lr_history.append(float(self.optimizers[0].param_groups[0]["lr"]))
        for i in range(self.num_replicas):
            if self.gradient_clip_val is not None:
                torch.nn.utils.clip_grad_norm_(self.params[i], self.gradient_clip_val)
            self.optimizers[i].step()
        self._after_inner_step(last)
        for scheduler in self.schedulers:
            if scheduler is not None:
                scheduler.step()
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
        """``steps`` inner steps; ``callback(self)`` after every ``every``-th one (0: never)."""
        for _ in range(steps):
            self.step()
            if every and callback is not None and self.step_count % every == 0:
                callback(self)

    def finish(self) -> None:
        """Lands rounds still in flight (the end of training) and stops the replicas' threads."""
        if not self.drivers:
            return
        for future in [self._pool.submit(driver.land_all) for driver in self.drivers]:
            future.result()
        self._pool.shutdown()

    # ------------------------------------------------------------------ measurements

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
            return [2 * (n - 1) * numel * 4 // n * self.step_count] * n
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
        ones when given. ``replicas``: evaluate only these replicas (the consensus still averages all)."""
        loss_fn = loss or self.loss_fn
        batches = list(batches)
        chosen = list(range(self.num_replicas)) if replicas is None else list(replicas)
        if weights is None:
            models = [*(self.replicas[i] for i in chosen), self.consensus_module()]
        else:
            mean = torch.stack(list(weights)).mean(0)
            models = [*(self._module_with(weights[i]) for i in chosen), self._module_with(mean)]
        results = []
        for model in models:
            was_training = model.training
            model.eval()
            total = sum(float(loss_fn(model, b)) for b in batches)
            model.train(was_training)
            results.append(total / max(1, len(batches)))
        return Evaluation(replica_losses=results[:-1], consensus_loss=results[-1])
