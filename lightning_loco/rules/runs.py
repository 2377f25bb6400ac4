"""The rules checked once the launch (the processes) and the fit (the model and its optimizers) are known (the
last part of the table of :mod:`lightning_loco.rules`)."""

from __future__ import annotations

from typing import Callable, Optional

from lightning_loco.driver.fragments import too_few_parameters
from lightning_loco.replica.options import Options
from lightning_loco.rules.table import Facts, Fit, Rules

# -- the launch: processes known, none started


RULES = Rules()
rule = RULES.rule


@rule("sync-batchnorm", "launch", ("Trainer.sync_batchnorm",), "`Trainer(sync_batchnorm=True)`",
      "each replica keeps its own statistics")
def _sync_batchnorm(f: Facts) -> Optional[str]:
    if f.launch is None or not f.launch.sync_batchnorm:
        return None
    return ("sync_batchnorm=True all-reduces batch statistics in every forward pass, which defeats low-communication "
            "training. Remove sync_batchnorm=True (each replica keeps its own statistics).")


@rule("elastic-one-replica-per-trainer", "launch", ("elastic", "ranks_per_replica", "Trainer.devices"),
      "`elastic` with processes ≠ `ranks_per_replica`", "one Trainer per replica: devices × nodes = k")
def _elastic_one_replica(f: Facts) -> Optional[str]:
    o, launch = f.options, f.launch
    if launch is None or o.elastic is None or launch.processes == o.ranks_per_replica:
        return None
    k = o.ranks_per_replica
    return (f"elastic replicas make this Trainer one replica of ranks_per_replica={k} process(es), but it has "
            f"{launch.processes} processes ({launch.nodes} node(s) × {launch.devices} device(s)). Use devices=1 and "
            "num_nodes=1 for a replica of one process, or devices × num_nodes = ranks_per_replica for a replica of "
            "several; start one Trainer per replica.")


@rule("ranks-divide-processes", "launch", ("ranks_per_replica", "Trainer.devices"),
      "`ranks_per_replica` not dividing the processes", "a divisor, e.g. the devices per node")
def _ranks_divide(f: Facts) -> Optional[str]:
    o, launch = f.options, f.launch
    if launch is None or o.elastic is not None or launch.processes % o.ranks_per_replica == 0:
        return None
    return (f"ranks_per_replica={o.ranks_per_replica} does not divide the {launch.processes} processes "
            f"({launch.nodes} node(s) × {launch.devices} device(s)). Use a divisor of {launch.processes}, e.g. the "
            f"devices per node ({launch.devices}) for one replica per node.")


@rule("replica-count", "launch", ("algorithm", "Trainer.devices"),
      "a number of replicas the schedule cannot serve (`topology='exponential'`: not a power of two)",
      "2, 4, 8, ... replicas, or another topology")
def _replica_count(f: Facts) -> Optional[str]:
    o, launch = f.options, f.launch
    if launch is None or o.elastic is not None or launch.processes % o.ranks_per_replica:
        return None
    try:
        o.algorithm.check_num_replicas(launch.processes // o.ranks_per_replica)
    except ValueError as err:
        return str(err)
    return None


# -- fit: the model and its optimizers known


def _paced(problem: Callable[[Options, Fit], Optional[str]]) -> Callable[[Facts], Optional[str]]:
    """A fit rule of pacing: replicas take different numbers of steps, so whatever Lightning does by a replica's
    own step or epoch count (a validation pass, a checkpoint) happens at different moments on different replicas,
    and a collective there would wait for replicas that are training towards their next round."""

    def check(f: Facts) -> Optional[str]:
        if f.fit is None or f.options.pacing is None:
            return None
        found = problem(f.options, f.fit)
        return None if found is None else f"pacing cannot run this fit: {found}."

    return check


for _name, _options, _refuses, _instead, _problem in (
    ("paced-one-optimizer", ("pacing",), "`pacing` with several optimizers", "one optimizer",
     lambda o, fit: None if len(fit.parameters) == 1 else
     f"it paces the rounds of one optimizer; this model has {len(fit.parameters)}"),
    ("paced-max-steps", ("pacing", "Trainer.max_steps"), "`pacing` without `max_steps`", "`Trainer(max_steps=...)`",
     lambda o, fit: None if fit.max_steps >= 1 else
     "the run is ⌈max_steps / sync_every⌉ rounds: set Trainer(max_steps=...)"),
    ("paced-no-max-epochs", ("pacing", "Trainer.max_epochs"), "`pacing` with `max_epochs`", "`max_steps` alone",
     lambda o, fit: None if fit.max_epochs in (None, -1) else
     f"replicas go through their data at different speeds: leave max_epochs unset (got {fit.max_epochs}) and end "
     "the run with max_steps"),
    ("paced-no-step-checkpoints", ("pacing", "Trainer.callbacks"), "`pacing` with a `ModelCheckpoint`",
     "`lightning_loco.OuterStepCheckpoint`",
     lambda o, fit: None if not fit.step_checkpoints else
     f"{', '.join(fit.step_checkpoints)} saves by each replica's own step or epoch count: use "
     "lightning_loco.OuterStepCheckpoint (every k outer steps) or enable_checkpointing=False"),
    ("paced-no-validation", ("pacing", "Trainer.limit_val_batches"), "`pacing` with validation during fit",
     "`limit_val_batches=0`, and validate after fit",
     lambda o, fit: None if not fit.validates else
     "validation during fit runs at each replica's own step or epoch count: set limit_val_batches=0 and validate "
     "after fit (trainer.validate) or from the checkpoints"),
):
    rule(_name, "fit", _options, _refuses, _instead)(_paced(_problem))


@rule("elastic-one-optimizer", "fit", ("elastic",), "`elastic` with several optimizers", "one optimizer")
def _elastic_one_optimizer(f: Facts) -> Optional[str]:
    if f.fit is None or f.options.elastic is None or len(f.fit.parameters) == 1:
        return None
    return (f"Elastic replicas support one optimizer for now; this model has {len(f.fit.parameters)}. Return one "
            "optimizer from configure_optimizers, or use elastic=None.")


@rule("fragments-enough-parameters", "fit", ("fragments",), "fewer parameters per optimizer than `fragments`",
      "`fragments` ≤ the parameters (a parameter is never split)")
def _fragments_enough(f: Facts) -> Optional[str]:
    o = f.options
    if f.fit is None or o.fragments == 1:
        return None
    fewest = min(f.fit.parameters, default=o.fragments)
    return None if fewest >= o.fragments else too_few_parameters(o.fragments, fewest)


@rule("outer-state-device", "fit", ("outer_state_device",),
      "`outer_state_device` on another accelerator than the model",
      "None (the model's device) or 'cpu'")
def _outer_state_device(f: Facts) -> Optional[str]:
    device = f.options.outer_state_device
    if f.fit is None or device is None or device.type in ("cpu", f.fit.model_device):
        return None
    return (f"outer_state_device={str(device)!r} does not match the model's device type {f.fit.model_device!r}. Use "
            "None or 'cpu'.")


@rule("disjoint-optimizers", "fit", ("configure_optimizers",), "a parameter in two optimizers",
      "disjoint parameter sets (each optimizer has its own outer state)")
def _disjoint_optimizers(f: Facts) -> Optional[str]:
    if f.fit is None or f.fit.shared_parameter is None:
        return None
    shape, a, b = f.fit.shared_parameter
    return (f"A parameter of shape {shape} belongs to optimizers {a} and {b}. Each parameter must belong to one "
            "optimizer: every optimizer has its own outer state. Give each optimizer a disjoint set of parameters.")
