"""Registration, argument checks and the Lightning compatibility shims (no processes)."""

import functools
import inspect
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_loco
from lightning_loco import DiLoCoStrategy, ElasticConfig, GASLoCStrategy, NoLoCoStrategy, PacingConfig
from lightning_loco._compat import disable_per_batch_sigterm_broadcast


def make_trainer(strategy, **kwargs):
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, **kwargs
    )


@pytest.mark.parametrize("name,cls,sync_every", [("noloco", NoLoCoStrategy, 50), ("diloco", DiLoCoStrategy, 500)])
def test_names_resolve_to_our_classes_with_paper_defaults(name, cls, sync_every):
    trainer = make_trainer(name)
    assert type(trainer.strategy) is cls
    assert trainer.strategy.sync_every == sync_every
    assert trainer.strategy.num_processes == 2


def test_registration_is_idempotent():
    import importlib

    importlib.reload(lightning_loco)
    importlib.reload(lightning_loco)
    assert StrategyRegistry["noloco"]["strategy"].__name__ == "NoLoCoStrategy"
    assert "diloco" in StrategyRegistry.available_strategies()


def test_paper_defaults():
    s = NoLoCoStrategy()
    a = s.algorithm
    assert (s.sync_every, a.outer_lr, a.outer_momentum, a.averaging_rate, a.group_size) == (50, 0.7, 0.5, 0.7, 2)
    d = DiLoCoStrategy().algorithm
    assert (d.outer_lr, d.outer_momentum, d.nesterov) == (0.7, 0.9, True)


@pytest.mark.parametrize("cls", [NoLoCoStrategy, DiLoCoStrategy])
@pytest.mark.parametrize("sync_every", [0, -3, 2.5, True, "10"])
def test_sync_every_must_be_a_positive_integer(cls, sync_every):
    with pytest.raises(ValueError, match="sync_every"):
        cls(sync_every=sync_every)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"outer_lr": 0}, "outer_lr"),
        ({"outer_momentum": 1}, "outer_momentum"),
        ({"group_size": 1}, "group_size"),
        ({"outer_state_device": "gpu0"}, "outer_state_device"),
        ({"outer_state_device": 3.5}, "outer_state_device"),
    ],
)
def test_noloco_strategy_rejects_bad_arguments_before_any_process(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NoLoCoStrategy(**kwargs)


def test_diloco_strategy_rejects_bad_arguments():
    with pytest.raises(ValueError, match="outer_lr"):
        DiLoCoStrategy(outer_lr=-0.7)
    with pytest.raises(ValueError, match="outer_momentum"):
        DiLoCoStrategy(outer_momentum=1.0)


@pytest.mark.parametrize("cls", [DiLoCoStrategy, GASLoCStrategy])
def test_a_custom_outer_optimizer_replaces_the_default_sgd_and_its_momentum_is_refused_beside_it(cls):
    custom = functools.partial(torch.optim.SGD, lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a stability warning about a γ that is not used
        strategy = cls(outer_optimizer=custom)
    assert strategy.algorithm.outer_optimizer is custom
    with pytest.raises(ValueError, match="outer_momentum=1.5 configures .* default outer SGD"):
        cls(outer_momentum=1.5, outer_optimizer=custom)  # it would configure nothing: refused, not ignored
    with pytest.raises(ValueError, match=r"outer_momentum.*must be in \[0, 1\)"):
        cls(outer_momentum=1.5)


def test_gasloc_with_a_custom_outer_optimizer_still_checks_what_it_uses():
    custom = functools.partial(torch.optim.Adam, lr=1e-3)
    with pytest.raises(ValueError, match="outer_lr"):
        GASLoCStrategy(outer_lr=0.0, outer_optimizer=custom)  # η still makes z = θ + η·g
    with pytest.raises(ValueError, match="gossip_step"):
        GASLoCStrategy(gossip_step=1.5, outer_optimizer=custom)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GASLoCStrategy(gossip_step=0.5, outer_optimizer=custom)  # γ = 0.8 would warn with the default SGD
    with pytest.warns(UserWarning, match="simulated") as caught:
        GASLoCStrategy(gossip_step=0.9, outer_optimizer=custom)  # α itself is outside what we simulated
    assert all("outer_momentum" not in str(w.message) for w in caught)


def test_gamma_outside_stability_interval_warns():
    with pytest.warns(UserWarning, match="stability interval"):
        NoLoCoStrategy(outer_momentum=0.5, averaging_rate=0.2)
    with pytest.warns(UserWarning, match="stability interval"):
        NoLoCoStrategy(outer_momentum=0.5, averaging_rate=1.6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NoLoCoStrategy(outer_momentum=0.5, averaging_rate=0.9)
        NoLoCoStrategy()  # the default γ = β = 0.7 is inside (0.5, 1.5)



@pytest.mark.parametrize("trainer,fabric", [
    (NoLoCoStrategy, lightning_loco.NoLoCoFabricStrategy),
    (GASLoCStrategy, lightning_loco.GASLoCFabricStrategy),
    (DiLoCoStrategy, lightning_loco.DiLoCoFabricStrategy),
])
def test_each_algorithms_strategies_declare_the_same_arguments_and_forward_the_rest(trainer, fabric):
    """The Trainer's and Fabric's strategy of an algorithm each declare its arguments in their own ``__init__``
    (with the same types and defaults) and forward ``**kwargs`` to their base; both say the same of themselves."""
    for cls in (trainer, fabric):
        assert "__init__" in vars(cls), cls
        assert list(inspect.signature(cls).parameters.values())[-1].kind is inspect.Parameter.VAR_KEYWORD
    assert inspect.signature(trainer) == inspect.signature(fabric)
    assert (trainer.__doc__, trainer.strategy_name, trainer.description) == \
        (fabric.__doc__, fabric.strategy_name, fabric.description)
    # The pattern is built apart, so that this file does not match it.
    ignored = "type: " + "ignore[call-arg]"
    library = Path(lightning_loco.__file__).parent
    assert [str(p) for p in sorted(library.rglob("*.py")) if ignored in p.read_text()] == []


@pytest.mark.parametrize("cls", [NoLoCoStrategy, DiLoCoStrategy])
def test_sync_batchnorm_is_rejected_when_the_trainer_is_built(cls):
    with pytest.raises(ValueError, match="sync_batchnorm"):
        make_trainer(cls(), sync_batchnorm=True)
    with pytest.raises(ValueError, match="sync_batchnorm"):
        make_trainer(cls.strategy_name, sync_batchnorm=True)


def test_outer_state_device_defaults_to_the_model_device():
    trainer = make_trainer(NoLoCoStrategy())
    assert trainer.strategy.outer_state_device == torch.device("cpu")
    assert make_trainer(NoLoCoStrategy(outer_state_device="cpu")).strategy.outer_state_device.type == "cpu"


class _LoopWithBroadcast:
    def __init__(self):
        self.trainer = type("T", (), {"received_sigterm": False})()
        self.calls = 0

    def _broadcast_sigterm_tensor(self):
        self.calls += 1


def test_sigterm_broadcast_is_replaced_by_a_local_check_and_restored():
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    loop = _LoopWithBroadcast()
    restore = disable_per_batch_sigterm_broadcast(loop)
    assert restore is not None
    loop._broadcast_sigterm_tensor()
    assert loop.calls == 0  # no broadcast
    loop.trainer.received_sigterm = True
    with pytest.raises(SIGTERMException):
        loop._broadcast_sigterm_tensor()  # this process's own SIGTERM still stops it
    restore()
    loop._broadcast_sigterm_tensor()
    assert loop.calls == 1


def test_sigterm_shim_is_a_no_op_on_a_lightning_without_the_broadcast():
    class OldLoop:
        pass

    loop = OldLoop()
    assert disable_per_batch_sigterm_broadcast(loop) is None
    assert not hasattr(loop, "_broadcast_sigterm_tensor")


def test_installed_lightning_has_the_broadcast_we_remove():
    # If Lightning renames or drops it, this fails and tells us to revisit _compat.py.
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))


@pytest.mark.parametrize("kwargs,match", [
    ({"pacing": 0}, "sync_seconds must be a number of seconds > 0"),
    ({"pacing": -2.0}, "sync_seconds must be a number of seconds > 0"),
    ({"pacing": "fast"}, "sync_seconds must be a number of seconds > 0"),
    ({"pacing": 1.0, "overlap_steps": 2}, "cannot be combined yet.*Use overlap_steps=0 with pacing"),
    ({"pacing": 1.0, "overlap_steps": "auto"}, "cannot be combined yet"),
    ({"pacing": 1.0, "elastic": ElasticConfig("localhost:29510")},
     "pacing \\(sync_seconds=1\\) and elastic replicas cannot be combined"),
])
@pytest.mark.parametrize("cls", [NoLoCoStrategy, GASLoCStrategy, DiLoCoStrategy])
def test_sync_seconds_is_checked_when_the_strategy_is_built(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(sync_every=10, **kwargs)
    assert cls(sync_every=10, pacing=2.5).sync_seconds == 2.5
    assert cls(sync_every=10, pacing=PacingConfig(2.5)).sync_seconds == 2.5
