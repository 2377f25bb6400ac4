"""The strategies under Lightning Fabric (``lightning_loco.fabric``): the names resolve, bad arguments are
refused when the strategy is built, and in real forked ranks a Fabric loop takes the Trainer's rounds bit for
bit (NoLoCo, GASLoC and DiLoCo; one and two ranks per replica), resumes exactly from ``fabric.save``, and
issues no global collective while it trains.

Each rank is a child forked from the test's process as torchrun starts ranks
(:func:`lightning_loco.testing.launch.fork_ranks`): Fabric and the Trainer both find their processes there.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_loco import (
    DiLoCoFabricStrategy,
    DiLoCoStrategy,
    ElasticConfig,
    GASLoCFabricStrategy,
    GASLoCStrategy,
    NoLoCoFabricStrategy,
    NoLoCoStrategy,
)
from lightning_loco.rules import RefusedOptions
from lightning_loco.testing.launch import fork_ranks

import tiny

FABRIC = {"noloco": NoLoCoFabricStrategy, "gasloc": GASLoCFabricStrategy, "diloco": DiLoCoFabricStrategy}
TRAINER = {"noloco": NoLoCoStrategy, "gasloc": GASLoCStrategy, "diloco": DiLoCoStrategy}
H, STEPS, BATCH = 2, 8, 4  # four rounds; each rank's 24 samples are 6 batches, so the run crosses an epoch


# ---------------------------------------------------------------- without processes


@pytest.mark.parametrize("name", list(FABRIC))
def test_the_names_resolve_to_the_fabric_strategies(name):
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=2)
    assert type(fabric.strategy) is FABRIC[name]
    assert fabric.strategy.sync_every == TRAINER[name]().sync_every  # the same defaults as the Trainer's


def _package_imports(path: Path) -> set[str]:
    """The ``lightning_loco`` modules a file imports (deferred imports included), as dotted names."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_loco")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_loco"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_the_fabric_strategies_import_no_trainer_module():
    """Every module of ``lightning_loco.fabric`` (its ``__init__`` and the strategies of each algorithm included),
    every package module they reach, and every package whose ``__init__`` importing those runs, import nothing of
    the Trainer's glue (``lightning_loco.trainer``): both adapt the same replica and take each algorithm's
    arguments from ``lightning_loco.algorithms.arguments`` (the package's own ``__init__``, which registers every
    strategy, aside)."""
    package = Path(__file__).resolve().parents[1]
    fabric = sorted((package / "lightning_loco" / "fabric").glob("*.py"))
    seen: set[str] = set()
    todo = [".".join(p.relative_to(package).with_suffix("").parts).removesuffix(".__init__") for p in fabric]
    assert {"lightning_loco.fabric", "lightning_loco.fabric.strategy"} <= set(todo)
    while todo:
        name = todo.pop()
        if name in seen or name == "lightning_loco":
            continue
        seen.add(name)
        todo.append(name.rpartition(".")[0])  # importing a module runs its package's __init__ first
        path = package / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        if path.exists():  # a name imported from a module (a class, a function) is not a file
            todo += sorted(_package_imports(path))
    assert {"lightning_loco.replica.replica", "lightning_loco.replica.run", "lightning_loco.algorithms.arguments",
            "lightning_loco.fabric.algorithm_strategies"} <= seen
    assert not [m for m in seen if m.startswith("lightning_loco.trainer")]


def test_fabric_takes_the_trainers_options_and_max_steps():
    import inspect

    from lightning_loco import FabricOuterStepStrategy, OuterStepStrategy

    def arguments(fn: Any) -> set[str]:
        return set(inspect.signature(fn).parameters) - {"self", "kwargs"}

    trainer = arguments(OuterStepStrategy.__init__) - {"precision_plugin"}
    assert arguments(FabricOuterStepStrategy.__init__) - {"precision", "max_steps"} == trainer
    for name in FABRIC:  # the algorithms' own arguments: one mixin for both
        assert arguments(FABRIC[name].__init__) == arguments(TRAINER[name].__init__)


@pytest.mark.parametrize("kwargs, rule", [
    ({"pacing": 2.0}, "fabric-not-paced"),
    ({"elastic": ElasticConfig("localhost:29510")}, "fabric-not-elastic"),
    ({"overlap_steps": 4, "sync_every": 4}, "overlap-within-round"),  # the Trainer's rules hold here too
])
def test_what_fabric_cannot_run_is_refused_when_the_strategy_is_built(kwargs, rule):
    with pytest.raises(RefusedOptions) as refused:
        NoLoCoFabricStrategy(**kwargs)
    assert rule in refused.value.rules
    assert "Use" in str(refused.value)  # the message says what to do instead


@pytest.mark.parametrize("max_steps", [0, -1, 2.5, True])
def test_max_steps_must_be_a_positive_integer(max_steps):
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1"):
        NoLoCoFabricStrategy(max_steps=max_steps)


# ---------------------------------------------------------------- in forked ranks


def _strategy_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {"sync_every": H, "ranks_per_replica": config.get("k", 1), **config.get("strategy", {})}


def trainer_rank(out: Path, config: dict[str, Any], rank: int) -> None:
    """``Trainer.fit`` of the tiny regressor for STEPS steps; this rank's final weights."""
    model = tiny.TinyRegressor(lr=0.05)
    trainer = L.Trainer(strategy=TRAINER[config["name"]](**_strategy_kwargs(config)), accelerator="cpu",
                        devices=config["world"], max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, accumulate_grad_batches=config.get("accumulate", 1))
    trainer.fit(model)
    torch.save({"final": tiny.flat(model)}, out / f"trainer{rank}.pt")


def fabric_rank(out: Path, config: dict[str, Any], rank: int) -> None:
    """The same training as a Fabric loop, written as LitGPT's pretraining loop is: ``fabric.setup``, the data
    loader set up by Fabric, forward, ``fabric.backward``, ``optimizer.step()``. With ``save_at``, a checkpoint
    at that step; with ``resume``, the run starts from that checkpoint; with ``count``, every torch.distributed
    call of the training steps is recorded. Sharded (FSDP2 inside): ``model="rooted"`` trains a model that holds
    a parameter itself, ``by_hand`` shards the model before ``fabric.setup_module``, and the reduce-scatters of
    each optimizer step are counted."""
    calls = tiny.CallLog()
    if config.get("count"):
        calls.install()
    strategy = FABRIC[config["name"]](max_steps=STEPS, **_strategy_kwargs(config))
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=config["world"])
    fabric.launch()
    model = Rooted() if config.get("model") == "rooted" else tiny.TinyRegressor(lr=0.05)
    make_optimizer = functools.partial(torch.optim.SGD, lr=0.05, momentum=config.get("momentum", 0.0))
    refused, second, scatters = None, None, ReduceScatters()
    if strategy.layout.sharded:
        # FSDP2 shards the parameters in place: an optimizer made before is refused, and the model is kept
        try:
            fabric.setup(model, make_optimizer(model.parameters()))
        except RuntimeError as error:
            refused = str(error)
        if config.get("by_hand"):  # as a user who shards the model over the replica's own ranks
            from torch.distributed.fsdp import fully_shard

            for part in (model.body, model.head):
                fully_shard(part, mesh=strategy.device_mesh["data_parallel"])
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
    else:
        model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
    try:
        fabric.setup_module(torch.nn.Linear(1, 1))  # one trained model per Fabric
    except RuntimeError as error:
        second = str(error)
    # shuffled by the distributed sampler, epoch by epoch, as the Trainer's training data is
    loader = fabric.setup_dataloaders(DataLoader(tiny.dataset(), batch_size=BATCH, shuffle=True))
    step, loaded = 0, None
    if config.get("resume"):
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(config["resume"], state)
        step = state["step"]
        loaded = tiny.flat(model)
    calls.active = True
    per_step = []
    accumulate = config.get("accumulate", 1)
    epoch = 0
    while accumulate > 1 and step < STEPS:  # gradient accumulation, as the Trainer's accumulate_grad_batches
        loader.sampler.set_epoch(epoch)
        epoch += 1
        for k, (x, y) in enumerate(loader):
            last = (k + 1) % accumulate == 0 or k + 1 == len(loader)  # the Trainer steps at an epoch's end too
            with fabric.no_backward_sync(model, enabled=not last):
                fabric.backward(torch.nn.functional.mse_loss(model(x).float(), y.float()) / accumulate)
            if last:
                optimizer.step()
                optimizer.zero_grad()
                per_step.append(scatters.take())
                step += 1
                if step == STEPS:
                    break
    skip = step  # a resumed run skips the batches it trained on, as LitGPT's loop does
    while step < STEPS:
        for x, y in loader:  # Fabric's loader sets the sampler's epoch at every pass
            if skip:
                skip -= 1
                continue
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            per_step.append(calls.take())
            if step == config.get("save_at"):
                calls.active = False
                fabric.save(config["checkpoint"], {"model": model, "optimizer": optimizer, "step": step})
                calls.active = True
            if step == STEPS:
                break
    calls.active = False
    finish_calls = None
    if config.get("finish"):  # the loop's end, as a loop without max_steps must call it
        calls.take()
        calls.active = True
        fabric.strategy.finish()
        calls.active = False
        finish_calls = calls.take()
    from torch.distributed.tensor import DTensor

    sharded = [isinstance(p, DTensor) for p in model.parameters()]
    consensus = fabric.strategy.consensus_state_dict() if config.get("consensus") else None
    torch.save({"final": tiny.flat(model), "calls": per_step, "outer_steps": fabric.strategy.outer_steps,
                "finished": fabric.strategy.finished, "sharded": sharded, "refused": refused, "second": second,
                "consensus": consensus, "loaded": loaded, "finish_calls": finish_calls}, out / f"fabric{rank}.pt")


class Rooted(torch.nn.Module):
    """A model that holds a parameter itself (its output scale), beside two layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(tiny.IN_FEATURES, 3), torch.nn.Linear(3, 1)
        self.scale = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x))) * self.scale.sum()


class ReduceScatters:
    """Counts FSDP2's reduce-scatters (whichever of torch's functions it calls) until :meth:`take`."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.count = 0
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original))

    def _wrap(self, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        return counted

    def take(self) -> list[tuple[str]]:
        taken, self.count = self.count, 0
        return [("reduce_scatter",)] * taken


def run(tmp_path: Path, kind: str, **config: Any) -> list[dict[str, Any]]:
    out = tmp_path / kind
    fn = {"trainer": trainer_rank, "fabric": fabric_rank}[kind]
    proc = fork_ranks(lambda rank: fn(out, config, rank), config["world"], out, 240, [kind, json.dumps(config)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out / f"{kind}{r}.pt") for r in range(config["world"])]


@pytest.mark.parametrize("name, world, k", [("noloco", 2, 1), ("gasloc", 2, 1), ("diloco", 2, 1),
                                            ("noloco", 4, 2)])
def test_a_fabric_loop_takes_the_trainers_rounds_bit_for_bit(tmp_path, name, world, k):
    trainer = run(tmp_path, "trainer", name=name, world=world, k=k)
    fabric = run(tmp_path, "fabric", name=name, world=world, k=k)
    for rank in range(world):
        assert torch.equal(fabric[rank]["final"], trainer[rank]["final"]), rank
        assert fabric[rank]["outer_steps"] == STEPS // H and fabric[rank]["finished"]
    # every replica ends on the replicas' average (average_at_end), as the Trainer's do
    assert all(torch.equal(f["final"], fabric[0]["final"]) for f in fabric)
    untrained = tiny.flat(tiny.TinyRegressor())
    assert not torch.equal(fabric[0]["final"], untrained)


FSDP = {"replica_sharding": "fsdp"}


@pytest.mark.parametrize("name", ["noloco", "diloco"])
def test_fsdp2_inside_a_replica_takes_the_trainers_rounds_bit_for_bit(tmp_path, name):
    """Two replicas of two ranks, FSDP2 inside each: ``fabric.setup_module`` shards the model as the Trainer's
    strategy does (the automatic policy), each rank steps and exchanges its own shards, and the run ends bitwise
    where ``Trainer.fit`` with ``replica_sharding="fsdp"`` ends; the consensus model is the full average."""
    trainer = run(tmp_path, "trainer", name=name, world=4, k=2, strategy=FSDP)
    fabric = run(tmp_path, "fabric", name=name, world=4, k=2, strategy=FSDP, consensus=True)
    for rank in range(4):
        assert torch.equal(fabric[rank]["final"], trainer[rank]["final"]), rank
        assert fabric[rank]["outer_steps"] == STEPS // H and fabric[rank]["finished"]
        assert all(fabric[rank]["sharded"]) and len(fabric[rank]["sharded"]) == 4
        assert "fabric.setup_module(model)" in fabric[rank]["refused"]  # setup(model, optimizer) was refused first
        assert "trains one model" in fabric[rank]["second"]  # a second model is refused, and the first trains on
    assert not torch.equal(fabric[0]["final"], tiny.flat(tiny.TinyRegressor()))
    full = fabric[0]["consensus"]  # global rank 0 only; every replica holds the average after the run
    assert all(f["consensus"] is None for f in fabric[1:])
    assert torch.equal(torch.cat([full[k].reshape(-1) for k in tiny.TinyRegressor().state_dict()]), fabric[0]["final"])
    # whole replicas (DDP inside) take the same rounds, up to the order of float additions
    whole = run(tmp_path / "whole", "fabric", name=name, world=4, k=2)
    assert torch.allclose(whole[0]["final"], fabric[0]["final"], atol=1e-6)


def test_a_sharded_fabric_run_resumes_exactly_from_fabric_save(tmp_path):
    """Every rank writes its own shards and outer state; the main file holds the full consensus model."""
    checkpoint = tmp_path / "ckpt" / "step3.ckpt"
    # the inner SGD with momentum: its state (a buffer per parameter, sharded like it) must come back too
    whole = run(tmp_path, "fabric", name="noloco", world=4, k=2, strategy=FSDP, save_at=3,
                checkpoint=str(checkpoint), momentum=0.9)
    resumed = run(tmp_path / "again", "fabric", name="noloco", world=4, k=2, strategy=FSDP, resume=str(checkpoint),
                  momentum=0.9)
    for rank in range(4):
        assert torch.equal(resumed[rank]["final"], whole[rank]["final"]), rank
    main = torch.load(checkpoint, weights_only=False)
    assert "optimizer" not in main and main["lightning_loco"]["shards"] == 2 and main["step"] == 3
    assert main["model"]["body.weight"].shape == (3, tiny.IN_FEATURES)  # full tensors, not one rank's shard
    # another number of replicas (one, of two ranks) starts from the main file's consensus model, each rank
    # taking its part of the full tensors; the inner optimizer starts fresh (a warning says so)
    one = run(tmp_path / "one", "fabric", name="noloco", world=2, k=2, strategy=FSDP, resume=str(checkpoint),
              momentum=0.9)
    consensus = torch.cat([main["model"][k].reshape(-1) for k in tiny.TinyRegressor().state_dict()])
    assert all(torch.equal(r["loaded"], consensus) for r in one)
    assert "start fresh" in (tmp_path / "one" / "fabric" / "stderr0.txt").read_text()


@pytest.mark.parametrize("world, k", [(2, 1), (4, 2)])
def test_gradient_accumulation_with_no_backward_sync_takes_the_trainers_rounds(tmp_path, world, k):
    """``fabric.no_backward_sync`` holds DDP's all-reduce back inside a replica of two ranks (and is a no-op with
    one rank per replica): two batches per optimizer step end bitwise as ``accumulate_grad_batches=2`` does."""
    trainer = run(tmp_path, "trainer", name="noloco", world=world, k=k, accumulate=2)
    fabric = run(tmp_path, "fabric", name="noloco", world=world, k=k, accumulate=2)
    for rank in range(world):
        assert torch.equal(fabric[rank]["final"], trainer[rank]["final"]), rank
        assert fabric[rank]["outer_steps"] == STEPS // H
    plain = run(tmp_path / "plain", "fabric", name="noloco", world=world, k=k)
    assert not torch.equal(plain[0]["final"], fabric[0]["final"])  # two batches a step: another run


def test_gradient_accumulation_in_a_sharded_replica_holds_fsdp2s_reduce_scatters_back(tmp_path):
    """``fabric.no_backward_sync`` in a sharded replica is FSDP2's ``set_requires_gradient_sync(False)``: each
    optimizer step reduce-scatters once per FSDP2 unit (the model's two layers), however many micro-batches it
    summed, and the run matches DDP inside (which all-reduces the sum once) to float rounding."""
    sharded = run(tmp_path, "fabric", name="noloco", world=4, k=2, accumulate=2, strategy=FSDP)
    whole = run(tmp_path / "whole", "fabric", name="noloco", world=4, k=2, accumulate=2)
    for rank in range(4):
        assert [len(step) for step in sharded[rank]["calls"]] == [2] * STEPS, rank  # two units, not 2 per batch
        assert torch.allclose(sharded[rank]["final"], whole[rank]["final"], rtol=0, atol=1e-7), rank
        assert sharded[rank]["outer_steps"] == STEPS // H


def test_a_model_sharded_by_hand_or_holding_a_parameter_itself_trains_sharded(tmp_path):
    """A model sharded with ``fully_shard(..., mesh=fabric.strategy.device_mesh["data_parallel"])`` before
    ``fabric.setup_module`` is taken as it is (the same units as the automatic policy: the same run, bitwise); a
    model holding a parameter itself is sharded with its top module as the last unit (a Fabric loop calls it)."""
    auto = run(tmp_path / "auto", "fabric", name="noloco", world=4, k=2, strategy=FSDP)
    by_hand = run(tmp_path / "hand", "fabric", name="noloco", world=4, k=2, strategy=FSDP, by_hand=True)
    rooted = run(tmp_path / "rooted", "fabric", name="noloco", world=4, k=2, strategy=FSDP, model="rooted")
    for rank in range(4):
        assert torch.equal(by_hand[rank]["final"], auto[rank]["final"]), rank
        assert rooted[rank]["sharded"] == [True] * 5 and rooted[rank]["outer_steps"] == STEPS // H
        assert torch.equal(rooted[rank]["final"], rooted[0]["final"])  # every replica ends on the average
    assert not torch.equal(rooted[0]["final"], tiny.flat(Rooted()))


def test_a_fabric_run_resumes_exactly_from_fabric_save(tmp_path):
    checkpoint = tmp_path / "ckpt" / "step3.ckpt"  # mid-round: H = 2, so the outer state is in the middle
    whole = run(tmp_path, "fabric", name="noloco", world=2, save_at=3, checkpoint=str(checkpoint))
    resumed = run(tmp_path / "again", "fabric", name="noloco", world=2, resume=str(checkpoint))
    for rank in range(2):
        assert torch.equal(resumed[rank]["final"], whole[rank]["final"]), rank
    # the main file holds the replicas' average as the model: what a plain load gives
    main = torch.load(checkpoint, weights_only=False)
    assert set(main) >= {"model", "optimizer", "step", "lightning_loco"} and main["step"] == 3


def test_a_fabric_loop_issues_no_global_collective_while_it_trains(tmp_path):
    """NoLoCo's rounds are pair exchanges (batch_isend_irecv with the one peer); nothing else is called while
    training, until the last step's average at the end (average_at_end: one all-reduce, opt-out)."""
    records = run(tmp_path, "fabric", name="noloco", world=2, count=True)
    for record in records:
        calls = record["calls"]
        training, last = calls[:-1], calls[-1]
        names = [c[0] for step in training for c in step]
        assert set(names) == {"batch_isend_irecv"}, names
        assert [k for k, step in enumerate(training, 1) if step] == [H, 2 * H, 3 * H]  # one exchange per round
        assert [c[0] for c in last] == ["batch_isend_irecv", "all_reduce"]  # the last round, then the average
