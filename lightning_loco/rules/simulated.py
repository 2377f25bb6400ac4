"""The rules of the simulator's own arguments, checked when it is built (``loop="simulator"``, the third part of
the table of :mod:`lightning_loco.rules`): DDP's gradient average, the modelled step times (``step_seconds``)
and pacing on them. A simulator without an algorithm has no options for the rules; it refuses the outer step's
options itself."""

from __future__ import annotations

from typing import Optional

from lightning_loco.rules.table import Facts, Rules, Simulated

RULES = Rules()
rule = RULES.rule


def _simulated(f: Facts) -> Optional[Simulated]:
    return f.simulated if f.loop == "simulator" else None


@rule("simulator-ddp-no-algorithm", "build", ("TrainingSimulator.gradient_averaging", "algorithm"),
      "the simulator's `gradient_averaging=True` with an algorithm", "`algorithm=None` (DDP)")
def _ddp_no_algorithm(f: Facts) -> Optional[str]:
    s = _simulated(f)
    if s is None or not s.gradient_averaging:
        return None
    return "gradient_averaging is DDP: pass algorithm=None with it"


@rule("simulator-one-stream", "build", ("wire",), "the simulator with an integer `WireConfig(streams)` > 1",
      "`streams=\"auto\"` or `1` (simulated replicas exchange in memory)")
def _one_stream(f: Facts) -> Optional[str]:
    if _simulated(f) is None or f.options.wire.streams in (1, "auto"):
        return None
    return (f"wire streams={f.options.wire.streams} spreads exchanges over TCP connections, and "
            "simulated replicas exchange in memory. Use streams=1 in the simulator (or the default, \"auto\": one "
            "stream there).")


@rule("simulator-step-seconds-whole-rounds", "build", ("TrainingSimulator.step_seconds", "fragments"),
      "the simulator's `step_seconds` with `fragments` ≠ 1", "`fragments=1`")
def _step_seconds_whole_rounds(f: Facts) -> Optional[str]:
    s, fragments = _simulated(f), f.options.fragments
    if s is None or not s.step_seconds or fragments == 1:
        return None
    return (f"fragments={fragments} splits the outer step's exchanges, and step_seconds models waits that follow "
            "whole-model rounds. Use fragments=1 with step_seconds.")


@rule("simulator-step-seconds-synchronous", "build", ("TrainingSimulator.step_seconds", "overlap_steps"),
      "the simulator's `step_seconds` with `overlap_steps` ≠ 0", "`overlap_steps=0`")
def _step_seconds_synchronous(f: Facts) -> Optional[str]:
    s, overlap_steps = _simulated(f), f.options.overlap_steps
    if s is None or not s.step_seconds or overlap_steps == 0:
        return None
    return f"step_seconds serves synchronous rounds only: use overlap_steps=0 with it, got {overlap_steps!r}"


def _paced(f: Facts) -> Optional[Simulated]:
    return _simulated(f) if f.options.pacing is not None else None


@rule("simulator-paced-step-seconds", "build", ("pacing", "TrainingSimulator.step_seconds"),
      "the simulator's `pacing` without `step_seconds`", "`step_seconds=[...]`, one per replica")
def _paced_step_seconds(f: Facts) -> Optional[str]:
    s = _paced(f)
    if s is None or s.step_seconds:
        return None
    return ("sync_seconds in the simulator paces every replica on its modelled step time: give "
            "step_seconds=[...] (one number of seconds per replica) with it")


@rule("simulator-paced-max-steps", "build", ("pacing", "TrainingSimulator.max_steps"),
      "the simulator's `pacing` without `max_steps`", "`max_steps`")
def _paced_max_steps(f: Facts) -> Optional[str]:
    s = _paced(f)
    if s is None or s.max_steps is not None:
        return None
    return ("sync_seconds needs max_steps: the run is ceil(max_steps / sync_every) rounds, ending on "
            "the same round on every replica")


@rule("simulator-paced-replica-loop", "build", ("pacing", "TrainingSimulator.batched"),
      "the simulator's `pacing` with `batched=True`", "`batched=False` or `'auto'`")
def _paced_replica_loop(f: Facts) -> Optional[str]:
    s = _paced(f)
    if s is None or s.batched is not True:
        return None
    return ("sync_seconds takes the loop over replicas (each takes its own steps per round): use "
            "batched=False or 'auto'")
