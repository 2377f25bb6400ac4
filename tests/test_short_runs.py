"""The short-run warning: the outer step's defaults on fewer outer steps than B5 showed they need
warn once when training starts (a Lightning fit, a simulator given ``max_steps``); a long run, tuned
settings and bad input are as before."""

from __future__ import annotations

import functools
import warnings

import lightning as L
import pytest
import torch

from lightning_loco import DiLoCoStrategy, GASLoCStrategy, NoLoCoStrategy
from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.replica.short_runs import SHORT_RUN, planned_outer_steps, short_run_note
from lightning_loco.simulator import TrainingSimulator, distributed_shards

import tiny

DEFAULTS = {"diloco": DiLoCo, "noloco": NoLoCo, "gasloc": GASLoC}
TUNED = {  # any outer-step argument moved from its default counts as tuned
    "diloco": [DiLoCo(outer_momentum=0.0), DiLoCo(outer_lr=0.5), DiLoCo(nesterov=False),
               DiLoCo(outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))],
    "noloco": [NoLoCo(outer_momentum=0.25), NoLoCo(outer_lr=0.5), NoLoCo(averaging_rate=0.6)],
    "gasloc": [GASLoC(outer_momentum=0.25), GASLoC(outer_lr=0.5), GASLoC(gossip_step=0.5),
               GASLoC(outer_optimizer=functools.partial(torch.optim.Adam, lr=1e-3))],
}


def test_every_threshold_names_what_it_rests_on():
    assert SHORT_RUN  # the measured thresholds are there
    for name, threshold in SHORT_RUN.items():
        assert name in DEFAULTS and threshold.outer_steps > 1
        assert any(c.isdigit() for c in threshold.measured)  # by how much B5 lost, in numbers
        assert "one replica trained alone" in threshold.measured  # against what
        for setting in ("outer_lr=", "outer_momentum=", "averaging_rate=", "gossip_step="):
            assert setting not in threshold.measured  # what the defaults did, not a setting named as better


@pytest.mark.parametrize("name", sorted(SHORT_RUN))
def test_the_defaults_on_a_short_run_warn_and_say_what_b5_lost(name):
    threshold = SHORT_RUN[name]
    note = short_run_note(DEFAULTS[name](), threshold.outer_steps - 1)
    assert note is not None
    assert f"{threshold.outer_steps - 1} outer step" in note and str(threshold.outer_steps) in note
    assert threshold.measured in note and "docs/tuning.md" in note
    assert short_run_note(DEFAULTS[name](), 1) is not None


@pytest.mark.parametrize("name", sorted(SHORT_RUN))
def test_the_warning_says_on_what_model_it_was_measured_and_recommends_no_setting(name):
    """What B5 measured rests on one model: the warning names it, says it need not hold for the user's, and
    points to the simulator to compare settings on their own model, rather than to fixed values."""
    note = short_run_note(DEFAULTS[name](), SHORT_RUN[name].outer_steps - 1)
    assert note is not None
    assert "one model, the byte-level example GPT on Shakespeare" in note and "B5" in note
    assert "need not hold for yours" in note
    assert "training simulator (docs/simulator.md" in note
    for recommended in ("outer_momentum=", "outer_lr=", "averaging_rate=", "gossip_step=", "measured better",
                        "better on short runs"):
        assert recommended not in note, recommended


@pytest.mark.parametrize("name", sorted(SHORT_RUN))
def test_a_long_run_a_tuned_one_and_no_outer_step_do_not_warn(name):
    threshold = SHORT_RUN[name]
    assert short_run_note(DEFAULTS[name](), threshold.outer_steps) is None
    assert short_run_note(DEFAULTS[name](), 10 * threshold.outer_steps) is None
    assert short_run_note(DEFAULTS[name](), 0) is None  # the "no outer step" warning covers that run
    assert short_run_note(DEFAULTS[name](), None) is None  # a run of unknown length
    for algorithm in TUNED[name]:
        assert short_run_note(algorithm, 1) is None, algorithm


def test_gasloc_is_judged_alike_in_either_form():
    warns = "gasloc" in SHORT_RUN
    for form in ("mixed", "sent"):
        assert (short_run_note(GASLoC(momentum_on=form), 1) is not None) == warns, form
        assert short_run_note(GASLoC(momentum_on=form, outer_momentum=0.25), 1) is None, form


def test_planned_outer_steps():
    assert planned_outer_steps(100, 10) == 10
    assert planned_outer_steps(109, 10) == 10  # the steps after the last round are no outer step
    assert planned_outer_steps(-1, 10) is None and planned_outer_steps(None, 10) is None
    assert planned_outer_steps(float("inf"), 10) is None


def short_name() -> str:
    return min(SHORT_RUN, key=lambda n: SHORT_RUN[n].outer_steps)


def simulator(algorithm, max_steps, sync_every=2):
    shards = distributed_shards(tiny.dataset(), 2, batch_size=4, shuffle=True, seed=0)
    return TrainingSimulator(tiny.TinyRegressor(), shards, algorithm, sync_every=sync_every, max_steps=max_steps,
                             batched=False)


def test_the_simulator_warns_once_when_built_with_a_short_max_steps():
    name = short_name()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = simulator(DEFAULTS[name](), max_steps=4)
        sim.run(4)
        sim.finish()
    notes = [w for w in caught if "docs/tuning.md" in str(w.message)]
    assert len(notes) == 1 and "2 outer step(s)" in str(notes[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        simulator(DEFAULTS[name](), max_steps=2 * SHORT_RUN[name].outer_steps).finish()  # long enough
        simulator(DEFAULTS[name](), max_steps=None).finish()  # the length is not known
        simulator(TUNED[name][0], max_steps=4).finish()
        simulator(None, max_steps=4).finish()  # independent replicas have no outer step


def test_bad_input_is_refused_as_before():
    name = short_name()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error comes first, with no warning before it
        with pytest.raises(ValueError, match="sync_every"):
            simulator(DEFAULTS[name](), max_steps=4, sync_every=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        DiLoCoStrategy(outer_momentum=1.5)


STRATEGIES = {"diloco": DiLoCoStrategy, "noloco": NoLoCoStrategy, "gasloc": GASLoCStrategy}


def fit(strategy, **trainer_kwargs) -> list[str]:
    """One in-process fit of one replica; the texts of the short-run warnings it gave. The world of one it
    joins, and the rendezvous variables Lightning puts in the environment, go when it ends: a later test
    that forks ranks from this process must not inherit them."""
    import os

    import torch.distributed as dist

    environment = dict(os.environ)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(tiny.TinyRegressor(),
                        train_dataloaders=torch.utils.data.DataLoader(tiny.dataset(), batch_size=4))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    return [str(w.message) for w in caught if "docs/tuning.md" in str(w.message)]


@pytest.mark.slow
def test_a_lightning_fit_warns_once_at_its_start():
    name = short_name()
    notes = fit(STRATEGIES[name](sync_every=2), max_steps=6)
    assert len(notes) == 1 and "3 outer step(s)" in notes[0]
    # max_epochs: 12 batches per epoch, 2 epochs, H = 4: 6 outer steps
    notes = fit(STRATEGIES[name](sync_every=4), max_epochs=2)
    assert len(notes) == 1 and "6 outer step(s)" in notes[0]
    long_enough = SHORT_RUN[name].outer_steps
    assert fit(STRATEGIES[name](sync_every=1), max_steps=long_enough) == []
    assert fit(STRATEGIES[name](sync_every=2, outer_momentum=0.25), max_steps=6) == []


def test_the_paper_values_given_explicitly_warn_and_the_message_says_how_to_keep_them_quietly(tmp_path):
    """The paper's values given explicitly are the defaults (LightningCLI passes every default): the note does not
    claim that setting them silences it; it names the warning's own category, which a filter silences."""
    import os
    import subprocess
    import sys
    import warnings

    import lightning as L

    import lightning_loco
    from lightning_loco.replica.short_runs import ShortRunWarning, warn_if_short

    explicit = lightning_loco.NoLoCo(outer_lr=0.7, outer_momentum=0.5)
    note = short_run_note(explicit, 5)
    assert note is not None and "Setting any outer-step argument" not in note
    assert "category=lightning_loco.ShortRunWarning" in note
    assert "PYTHONWARNINGS='ignore:NoLoCo with its default outer step'" in note
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_short(explicit, 250, 50, warnings.warn)
    assert [w.category for w in caught] == [ShortRunWarning]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=lightning_loco.ShortRunWarning)
        warn_if_short(explicit, 250, 50, L.pytorch.utilities.rank_zero_warn)  # the strategies' way of warning
    assert caught == []
    # the command line's filter, as the note gives it, works too (a new interpreter reads PYTHONWARNINGS)
    code = ("import warnings, lightning_loco; from lightning_loco.replica.short_runs import warn_if_short; "
            "warn_if_short(lightning_loco.NoLoCo(), 250, 50, warnings.warn)")
    for env, warned in ({}, True), ({"PYTHONWARNINGS": "ignore:NoLoCo with its default outer step"}, False):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env})
        assert proc.returncode == 0 and ("ShortRunWarning" in proc.stderr) == warned, proc.stderr
