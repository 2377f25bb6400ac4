"""The machinery of the rules (:mod:`lightning_loco.rules`): what a rule may look at (:class:`Facts`:
the options, and what the launch and the fit add once known), one :class:`Rule`, the table :data:`RULES` in
its parts (:class:`Rules`), and :class:`RefusedOptions`, what a refusal raises. The rules themselves are in
``rules/options.py``, ``rules/modes.py`` and ``rules/runs.py``, a part each; :mod:`lightning_loco.rules`
puts the parts together in the table's order and checks them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from lightning_loco.replica.options import Options

# ---------------------------------------------------------------- facts known later than the options


@dataclass(frozen=True)
class Launch:
    """What the Trainer knows once it is built: the processes of the run (before any starts)."""

    nodes: int
    devices: int  # processes per node
    sync_batchnorm: bool = False

    @property
    def processes(self) -> int:
        return self.nodes * self.devices


@dataclass(frozen=True)
class Fit:
    """What ``fit`` knows when it starts: the model's optimizers and the Trainer's loop."""

    parameters: tuple[int, ...]  # parameters (tensors) per optimizer
    max_steps: int = -1
    max_epochs: Optional[int] = None
    validates: bool = False  # validation runs during fit
    step_checkpoints: tuple[str, ...] = ()  # callbacks that save by the replica's own step or epoch count
    model_device: str = "cpu"  # the device type the model is on
    shared_parameter: Optional[tuple[tuple[int, ...], int, int]] = None  # (shape, optimizer, optimizer) of one


@dataclass(frozen=True)
class Simulated:
    """What the simulator adds to the options when it is built (its loop is ``"simulator"``)."""

    gradient_averaging: bool = False  # DDP's gradient average at every step
    step_seconds: bool = False  # modelled step times were given
    max_steps: Optional[int] = None
    batched: Any = "auto"  # True, False or "auto"


Loop = Literal["trainer", "fabric", "simulator"]


@dataclass(frozen=True)
class Facts:
    """What a rule may look at: the options, and what the launch and the fit add once known."""

    options: Options
    launch: Optional[Launch] = None
    fit: Optional[Fit] = None
    loop: Loop = "trainer"  # whose training loop: Lightning's Trainer, a Fabric loop, or the simulator's
    simulated: Optional[Simulated] = None  # the simulator's own arguments (loop "simulator")


def shared_parameter(parameters: Sequence[Sequence[Any]]) -> Optional[tuple[tuple[int, ...], int, int]]:
    """:attr:`Fit.shared_parameter` of optimizers that hold ``parameters`` (a list per optimizer): the shape of the
    first parameter found in two of them, and the two optimizers; None where each belongs to one."""
    owner: dict[int, int] = {}
    for k, params in enumerate(parameters):
        for p in params:
            if owner.setdefault(id(p), k) != k:
                return tuple(p.shape), owner[id(p)], k
    return None


# ---------------------------------------------------------------- the table of rules


class RefusedOptions(ValueError):
    """Options that cannot run together: the message says what to do instead; ``rules`` names the rules of
    the table that refused them."""

    def __init__(self, message: str, rules: Sequence[str]) -> None:
        super().__init__(message)
        self.rules = tuple(rules)


When = Literal["build", "launch", "fit"]


@dataclass(frozen=True)
class Rule:
    """One combination that cannot run. ``check(facts)`` returns what the user is told (the message
    says what to do instead), or None where the facts are fine. ``refuses`` and ``instead`` are the
    docs table's words."""

    name: str
    when: When
    options: tuple[str, ...]
    refuses: str
    instead: str
    check: Callable[[Facts], Optional[str]]


class Rules(list[Rule]):
    """A part of the table, in its order: ``@part.rule(...)`` adds the decorated check to it."""

    def rule(self, name: str, when: When, options: tuple[str, ...], refuses: str,
             instead: str) -> Callable[[Callable[[Facts], Optional[str]]], Rule]:
        def add(check: Callable[[Facts], Optional[str]]) -> Rule:
            made = Rule(name, when, options, refuses, instead, check)
            self.append(made)
            return made

        return add
