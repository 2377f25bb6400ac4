"""The one table of rules that says which combinations of options run (docs/options.md renders it).

Every combination that cannot run is refused by one :class:`Rule` of :data:`RULES` (its message says what
to do instead). A rule is checked as soon as the facts it needs exist:

* ``build``: when the options (the strategy) are built, from the options alone (:func:`build_options`);
* ``launch``: when the Trainer is built and the number of processes is known, before any starts;
* ``fit``: when ``fit`` starts, in one place, once the model and its optimizers are known.

Whatever no rule refuses runs, and every option given takes effect: an option that only applies with
another one is refused without it (``tests/test_options.py`` proves both). The adapters (the Trainer's and
Fabric's strategies) and the simulator check the rules; the driver reads the options and knows none.
The rules are defined, in the table's order, in ``rules/options.py`` (the options alone), ``rules/modes.py``
(elastic replicas, the wire's streams, a Fabric loop, an algorithm's own arguments), ``rules/simulated.py``
(the simulator's own arguments) and ``rules/runs.py``
(the launch and the fit); their machinery is ``rules/table.py``.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.replica.options import Options
from lightning_loco.rules import modes as _modes
from lightning_loco.rules import options as _options
from lightning_loco.rules import runs as _runs
from lightning_loco.rules import simulated as _simulated
from lightning_loco.rules.table import Facts, Fit, Launch, Loop, RefusedOptions, Rule, Simulated, When

RULES: list[Rule] = [*_options.RULES, *_modes.RULES, *_simulated.RULES, *_runs.RULES]  # the table, in its order

__all__ = ["RULES", "Facts", "Fit", "Launch", "RefusedOptions", "Rule", "Simulated", "build_options", "check_rules",
           "rules_table"]


def check_rules(when: When, facts: Facts) -> None:
    """Raises :class:`RefusedOptions` with the message of every rule checked ``when`` that refuses ``facts``
    (one message alone as it is; several as a list)."""
    refused = [(r.name, m) for r in RULES if r.when == when for m in [r.check(facts)] if m is not None]
    if not refused:
        return
    names, messages = zip(*refused)
    if len(messages) == 1:
        raise RefusedOptions(messages[0], names)
    raise RefusedOptions(f"{len(messages)} options do not fit together:\n" + "\n".join(f"- {m}" for m in messages),
                         names)


def build_options(algorithm: OuterAlgorithm, sync_every: int, *, loop: Loop = "trainer",
                  simulated: Optional[Simulated] = None, **others: Any) -> Options:
    """:meth:`Options.build` (each option checked), then the ``build`` rules over them for ``loop``'s training
    loop (the simulator's with its own arguments, ``simulated``): the options of a run that the rules let
    through, or :class:`RefusedOptions`."""
    options = Options.build(algorithm, sync_every, **others)
    check_rules("build", Facts(options, loop=loop, simulated=simulated))
    return options


def rules_table() -> str:
    """:data:`RULES` as the Markdown table of docs/options.md."""
    lines = ["| checked | rule | options | refused | instead |", "|---|---|---|---|---|"]
    for r in RULES:
        options = ", ".join(f"`{o}`" for o in r.options)
        lines.append(f"| {r.when} | `{r.name}` | {options} | {r.refuses} | {r.instead} |")
    return "\n".join(lines)
