"""Strategies pickle, as ``start_method="spawn"`` (and "forkserver") needs: the default outer SGD, a
user's ``functools.partial``, what LightningCLI builds from a YAML ``outer_optimizer``, and a real
two-process spawn run of each strategy."""

import functools
import pickle
import sys
from datetime import timedelta

import lightning as L
import pytest
import torch

from lightning_loco import DiLoCoStrategy, GASLoCStrategy
from lightning_loco.algorithms.outer_optimizer import SGDFactory
from lightning_loco.testing.launch import strategy_class

import tiny

NAMES = ["noloco", "diloco", "gasloc"]
ADAM = functools.partial(torch.optim.Adam, lr=1e-3)


def build_adam(params):
    """A module-level factory: pickles by reference."""
    return torch.optim.Adam(params, lr=2e-3)


def outer_optimizer_of(strategy):
    """The optimizer the strategy's algorithm builds over two parameter tensors: its type and groups."""
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    optimizer = strategy.algorithm.outer_optimizer(params)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return type(optimizer), groups


def round_trip(strategy):
    return pickle.loads(pickle.dumps(strategy))


@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_pickles_with_default_arguments(name):
    strategy = strategy_class(name)(start_method="spawn")
    copy = round_trip(strategy)
    assert type(copy) is type(strategy)
    assert vars(copy.algorithm) == vars(strategy.algorithm)
    if name != "noloco":
        assert outer_optimizer_of(copy) == outer_optimizer_of(strategy)
        assert outer_optimizer_of(copy)[0] is torch.optim.SGD


def test_the_default_outer_sgds_are_picklable_values():
    assert DiLoCoStrategy().algorithm.outer_optimizer == SGDFactory(0.7, 0.9, True)
    assert GASLoCStrategy(outer_momentum=0.3).algorithm.outer_optimizer == SGDFactory(1.0, 0.3, True)
    assert pickle.loads(pickle.dumps(SGDFactory(0.5, 0.0, True))) == SGDFactory(0.5, 0.0, True)
    (group,) = outer_optimizer_of(DiLoCoStrategy(outer_lr=0.5, outer_momentum=0.0))[1]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.5, 0.0, False)  # torch: no Nesterov at 0


@pytest.mark.parametrize("name", ["diloco", "gasloc"])
@pytest.mark.parametrize("factory", [ADAM, build_adam], ids=["partial", "function"])
def test_a_given_outer_optimizer_survives_pickling(name, factory):
    strategy = strategy_class(name)(outer_optimizer=factory, start_method="spawn")
    copy = round_trip(strategy)
    assert outer_optimizer_of(copy) == outer_optimizer_of(strategy)
    assert outer_optimizer_of(copy)[0] is torch.optim.Adam


@pytest.mark.parametrize("name", ["diloco", "gasloc"])
def test_an_unpicklable_outer_optimizer_fails_early_only_where_it_must_travel(name):
    def local(params):
        return torch.optim.Adam(params)

    for factory in (local, lambda params: torch.optim.Adam(params)):
        for start_method in ("spawn", "forkserver"):
            with pytest.raises(ValueError, match="module-level function or functools.partial"):
                strategy_class(name)(outer_optimizer=factory, start_method=start_method)
        for start_method in ("popen", "fork"):  # nothing is pickled there
            strategy_class(name)(outer_optimizer=factory, start_method=start_method)


@pytest.mark.parametrize(
    "name,outer_optimizer",
    [("diloco", None), ("diloco", "adam"), ("gasloc", "adam")],
)
def test_an_outer_optimizer_from_a_cli_config_pickles(tmp_path, monkeypatch, name, outer_optimizer):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["lightning-loco"])  # only the config below

    init_args = "      start_method: spawn\n      sync_every: 2\n"
    if outer_optimizer == "adam":  # as a user writes it: the parameters are left out
        init_args += (
            "      outer_optimizer:\n        class_path: torch.optim.Adam\n        init_args:\n          lr: 0.001\n"
        )
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy:\n"
        f"    class_path: lightning_loco.{strategy_class(name).__name__}\n    init_args:\n{init_args}"
    )
    cli = LightningCLI(
        tiny.TinyRegressor, run=False, args=["--config", str(config)], seed_everything_default=False,
        save_config_callback=None,
    )
    strategy = cli.trainer.strategy
    assert type(strategy) is strategy_class(name) and strategy.sync_every == 2
    copy = round_trip(strategy)
    assert outer_optimizer_of(copy) == outer_optimizer_of(strategy)
    optimizer_type, (group,) = outer_optimizer_of(copy)
    if outer_optimizer == "adam":
        assert optimizer_type is torch.optim.Adam and group["lr"] == 0.001
    else:
        assert optimizer_type is torch.optim.SGD and group["lr"] == 0.7


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_replicas_train_under_spawn(tmp_path, name, monkeypatch):
    """A real launch with start_method="spawn": the Trainer, the strategy and the callbacks are pickled
    to two fresh processes. Each rank records its weights; rank 0's final weights come back to this
    process, averaged over the replicas at the end of fit."""
    # Lightning's launcher puts MASTER_ADDR/MASTER_PORT into this process's environment; they go with the
    # test, or every process a later test starts from here would inherit this run's port
    for variable in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)  # and when the test ends, back to as it was
    strategy = strategy_class(name)(start_method="spawn", sync_every=2, timeout=timedelta(seconds=60))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=4,
        callbacks=[tiny.Recorder(str(tmp_path), tiny.CallLog())],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = tiny.TinyRegressor()
    initial = tiny.flat(model)
    trainer.fit(model)
    assert trainer.state.finished
    records = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, record in enumerate(records):
        assert record["rank"] == rank and record["world_size"] == 2
        assert record["strategy"] == strategy_class(name).__name__
        assert torch.equal(record["initial"], initial)
        (outer,) = record["outer_states"]
        assert outer["inner_steps"] == 4 and outer["outer_steps"] == 2
    ends = [record["weights"][-1] for record in records]  # before the end-of-fit average
    final = tiny.flat(model)  # rank 0's weights after it
    assert torch.allclose(final, (ends[0] + ends[1]) / 2, atol=1e-6)
    assert not torch.allclose(final, initial)
