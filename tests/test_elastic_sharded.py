"""FSDP2 inside an elastic replica: what rank i of a donor hands to rank i of a joiner.

Two forked ranks over gloo form one replica sharded with FSDP2 and hold two models sharded alike: a donor
that trained a few AdamW steps and a fresh joiner. The donor's training state (``LightningTrainingState``)
crosses as the heal's header does (``torch.save``, loaded with ``weights_only``) and is loaded into the
joiner's ``DTensor`` objects shard by shard. The weights themselves travel as the driver's flat local shards
(:class:`~lightning_loco.driver.flat.ShardedParameters`), as the elastic plug-in sends them. The real-process run
(a rank killed, the replica restarted) is in tests/test_elastic.py.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_loco.testing.launch import free_port, init_gloo, start_ranks


class Model(nn.Module):
    """A trained part, a frozen part (sharded, never stepped) and a buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))  # 1 row: rank 1's shard is empty
        self.frozen = nn.Linear(1, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("seen", torch.zeros(2))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.frozen(self.net(x)).square().mean()


class Fit:
    """What ``LightningTrainingState`` reads of a Trainer: a real Trainer's fit loop and precision plugin,
    this rank's sharded module, its optimizer and LR scheduler."""

    def __init__(self, module: Model, lr: float) -> None:
        import lightning as L

        real = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
        self.fit_loop, self.precision_plugin, self.lightning_module = real.fit_loop, real.precision_plugin, module
        self.optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (1 + step))
        self.strategy = SimpleNamespace(optimizers=[self.optimizer])
        self.lr_scheduler_configs = [SimpleNamespace(scheduler=self.scheduler)]

    def step(self, x: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        self.lightning_module.loss(x).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.fit_loop.epoch_loop._batches_that_stepped += 1


def sharded(fit: Fit) -> Any:
    """The FSDP2 layout of ``fit``'s module (what a strategy with replica_sharding gives the training state)."""
    from lightning_loco.replica.layout import ShardedReplicas
    from lightning_loco.replica.options import FSDPConfig

    return ShardedReplicas(SimpleNamespace(module=fit.lightning_module), FSDPConfig())


def _local(obj: Any) -> Any:
    from lightning_loco.replica import sharding
    return sharding.local_tree(obj)


def _equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested states (tensors: same dtype, shape and values)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _round_trip_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.tensor import DTensor

    from lightning_loco.driver.flat import ShardedParameters
    from lightning_loco.elastic import state_transfer as heal
    from lightning_loco.replica import sharding
    from lightning_loco.trainer.training_state import LightningTrainingState

    init_gloo(rank, 2, port=port, timeout_s=30)
    try:
        mesh = sharding.replica_mesh("cpu", 2, "gloo", None).mesh["data_parallel"]
        donor_module, joiner_module = Model(0), Model(1)
        for module in (donor_module, joiner_module):
            from lightning_loco.replica.options import FSDPConfig

            sharding.auto_shard(module, mesh, FSDPConfig())
        donor, joiner = Fit(donor_module, 0.05), Fit(joiner_module, 0.01)
        g = torch.Generator().manual_seed(10 + rank)  # each rank its own batches, as in a replica
        for _ in range(3):
            donor.step(torch.randn(6, 4, generator=g))
        out: dict[str, Any] = {}

        # the donor's export: local tensors only, and the layout of its shards
        state = LightningTrainingState(donor, sharded(donor)).for_plugin().export(True)
        tensors: list[torch.Tensor] = []
        heal.split(state, tensors)
        out["no_dtensor"] = bool(tensors) and not any(isinstance(t, DTensor) for t in tensors)
        out["layout"] = state["layout"] == sharding.layout(donor_module)
        head = heal.header(1, 3, ["B"], "A")
        state = heal.decode(heal.encode(state, head), head)  # as it crosses (weights_only)

        # the joiner takes it, and the weights as the plug-in sends them: flat local shards
        taker = LightningTrainingState(joiner, sharded(joiner)).for_plugin()
        assert taker.check is not None
        taker.check(state)
        taker.load(state, True)
        trained = [[p for p in m.parameters() if p.requires_grad] for m in (donor_module, joiner_module)]
        ShardedParameters(trained[1], "cpu").scatter(ShardedParameters(trained[0], "cpu").gather())
        sharding.reshard(joiner_module)
        out["optimizer"] = _equal(_local(joiner.optimizer.state_dict()), _local(donor.optimizer.state_dict()))
        out["moments_sharded"] = all(isinstance(v, DTensor) and v.placements == p.placements
                                     for p in trained[1] for v in [joiner.optimizer.state[p]["exp_avg"]])
        out["module"] = _equal(_local(joiner_module.state_dict()), _local(donor_module.state_dict()))
        out["scheduler"] = joiner.scheduler.state_dict() == donor.scheduler.state_dict()
        out["lr"] = joiner.optimizer.param_groups[0]["lr"] == donor.optimizer.param_groups[0]["lr"]
        out["logged_steps"] = joiner.fit_loop.epoch_loop._batches_that_stepped == 3

        # from there both step alike, bitwise
        x = torch.randn(6, 4, generator=g)
        donor.step(x)
        joiner.step(x)
        out["stepped"] = _equal(_local(joiner_module.state_dict()), _local(donor_module.state_dict()))
        out["stepped_optimizer"] = _equal(_local(joiner.optimizer.state_dict()), _local(donor.optimizer.state_dict()))

        # a donor sharded otherwise, or not at all: refused before anything is loaded
        errors = []
        for bad in ({**state, "layout": state["layout"][:-1]}, {k: v for k, v in state.items() if k != "layout"}):
            try:
                taker.check(bad)
                errors.append("")
            except RuntimeError as err:
                errors.append(str(err))
        out["errors"] = errors
        dist.barrier()
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_an_fsdp_ranks_training_state_crosses_as_local_shards_and_loads_back_bitwise(tmp_path):
    start_ranks(_round_trip_worker, 2, args=(free_port(), str(tmp_path)), start_method="fork")
    for rank in range(2):
        out = torch.load(tmp_path / f"{rank}.pt")
        errors = out.pop("errors")
        assert all(out.values()), (rank, out)
        assert "shards the model differently" in errors[0] and "parameters here" in errors[0], errors[0]
        assert "this replica is sharded, the donor not" in errors[1], errors[1]
        assert all("nothing of its state was loaded" in e for e in errors)
