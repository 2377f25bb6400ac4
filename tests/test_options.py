"""The options (``lightning_loco.replica.options``) and their one table of rules (``lightning_loco.rules``),
without processes.

What the table says is proved here: every rule refuses its own example (and no other rule does), the
defaults pass every rule, docs/options.md renders the table as it is, every argument of the strategies
is an option, an outer step's argument or one of DDPStrategy's, and every option given takes effect in
every combination the rules let through (a run with it differs from the same run without it, bitwise).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import re
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lightning_loco import ElasticConfig, PacingConfig, WireConfig
from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.replica.options import Options
from lightning_loco.rules import (
    RULES,
    Facts,
    Fit,
    Launch,
    RefusedOptions,
    build_options,
    check_rules,
    rules_table,
)
from lightning_loco.simulator import TrainingSimulator
from lightning_loco.testing.launch import strategy_class
from lightning_loco.trainer.base import OuterStepStrategy
from lightning_loco.transport import InProcessNetwork

from test_driver import run_in_threads

ROOT = Path(__file__).resolve().parents[1]
DDP_ARGUMENTS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                 "process_group_backend", "timeout", "start_method"}


_ELASTIC = ElasticConfig("localhost:29510", replica_id="example")  # the examples' elastic replica
_ADAM = functools.partial(torch.optim.Adam, lr=1e-3)  # the examples' outer optimizer
_PACED = {"pacing": 1.0}
_PACED_FIT = {"parameters": (3,), "max_steps": 8}
_SECONDS = [1.0, 2.0]  # the examples' modelled step times, for the simulator's two replicas

# Each rule's example: a strategy's arguments (``"strategy"``: its name, default NoLoCo's; ``"simulator"``: the
# simulator's arguments, two replicas of NoLoCo) that this rule alone refuses, and for a launch or fit rule the
# facts that make it refuse them (``"launch"``: Launch's fields; ``"fit"``: Fit's).
EXAMPLES: dict[str, dict[str, Any]] = {
    "overlap-within-round": {"sync_every": 4, "overlap_steps": 4},
    "merge-needs-overlap": {"overlap_merge": "delayed"},
    "fragments-divide-sync-every": {"sync_every": 6, "fragments": 4},
    "overlap-within-fragment": {"sync_every": 6, "fragments": 2, "overlap_steps": 3},
    "fragments-not-paced": {"sync_every": 4, "fragments": 2, "pacing": 1.0},
    "fragments-not-elastic": {"sync_every": 4, "fragments": 2, "elastic": _ELASTIC},
    "fragments-not-sharded": {"sync_every": 4, "fragments": 2, "replica_sharding": "fsdp"},
    "pacing-not-overlapped": {"pacing": 1.0, "overlap_steps": 2},
    "auto-pacing-one-rank": {"pacing": "auto", "ranks_per_replica": 2},
    "steps-merge-algorithm": {"strategy": "gasloc", "pacing": PacingConfig(1.0, merge="steps")},
    "steps-merge-exact-wire": {"pacing": PacingConfig(1.0, merge="steps"), "wire": "bfloat16"},
    "block-size-block-formats": {"wire": WireConfig("bfloat16", block_size=64)},
    "sparse-options-topk-only": {"wire": WireConfig("int4", density=0.01)},
    "topk-pseudo-gradient-only": {"wire": "topk"},
    "topk-needs-error-feedback": {"strategy": "diloco", "outer_momentum": 0.0,
                                  "wire": WireConfig("topk", error_feedback=False)},
    "senders-mean-without-momentum": {"strategy": "diloco", "wire": "topk"},
    "decay-needs-error-feedback": {"strategy": "noloco", "wire": WireConfig("int8", error_feedback_decay=0.95)},
    "error-feedback-lossy-only": {"wire": WireConfig("float32", error_feedback=True)},
    "outer-optimizer-pickles": {"strategy": "diloco", "start_method": "spawn",
                                "outer_optimizer": lambda p: torch.optim.SGD(p, lr=1)},
    "sharded-launch": {"replica_sharding": "fsdp", "start_method": "spawn"},
    "elastic-not-overlapped": {"elastic": _ELASTIC, "overlap_steps": 2},
    "elastic-collective-lossy-ranks": {"strategy": "diloco", "elastic": _ELASTIC, "ranks_per_replica": 2,
                                       "wire": "int8"},
    "elastic-any-replica-count": {"strategy": "gasloc", "topology": "exponential", "elastic": _ELASTIC},
    "elastic-not-paced": {"elastic": _ELASTIC, "pacing": 1.0},
    "elastic-own-transport": {"elastic": _ELASTIC, "transport_factory": lambda **kw: None},
    "streams-one-rank-per-replica": {"wire": WireConfig(streams=4), "ranks_per_replica": 2},
    "streams-own-transport": {"wire": WireConfig(streams=4), "transport_factory": lambda **kw: None},
    "elastic-no-average-at-end": {"elastic": _ELASTIC, "average_at_end": True},
    "elastic-straggler-below-timeout": {"elastic": ElasticConfig("localhost:29510", replica_id="example",
                                                                 outer_step_timeout=60.0, straggler_timeout=60.0)},
    "elastic-data-slot-needs-slots": {"elastic": ElasticConfig("localhost:29510", replica_id="example", data_slot=1)},
    "elastic-data-slot-below-slots": {"elastic": ElasticConfig("localhost:29510", replica_id="example", data_slots=2,
                                                               data_slot=2)},
    "elastic-replica-id-names-slot": {"elastic": ElasticConfig("localhost:29510", replica_id="example",
                                                               data_slots=2)},
    "fabric-not-paced": {"strategy": "fabric:noloco", "pacing": 1.0},
    "fabric-not-elastic": {"strategy": "fabric:noloco", "elastic": _ELASTIC},
    "diloco-sgd-or-outer-optimizer": {"strategy": "diloco", "outer_momentum": 0.5, "outer_optimizer": _ADAM},
    "gasloc-momentum-or-outer-optimizer": {"strategy": "gasloc", "outer_momentum": 0.8, "outer_optimizer": _ADAM},
    "gasloc-sent-default-optimizer": {"strategy": "gasloc", "momentum_on": "sent", "outer_optimizer": _ADAM},
    "gasloc-gossip-step-matchings": {"strategy": "gasloc", "topology": "complete", "gossip_step": 0.5},
    "gasloc-seed-random-pairs": {"strategy": "gasloc", "topology": "ring", "seed": 3},
    "simulator-ddp-no-algorithm": {"strategy": "simulator", "gradient_averaging": True},
    "simulator-one-stream": {"strategy": "simulator", "wire": WireConfig(streams=4)},
    "simulator-step-seconds-whole-rounds": {"strategy": "simulator", "sync_every": 4, "fragments": 2,
                                            "step_seconds": _SECONDS},
    "simulator-step-seconds-synchronous": {"strategy": "simulator", "overlap_steps": 1, "step_seconds": _SECONDS},
    "simulator-paced-step-seconds": {"strategy": "simulator", **_PACED, "max_steps": 8},
    "simulator-paced-max-steps": {"strategy": "simulator", **_PACED, "step_seconds": _SECONDS},
    "simulator-paced-replica-loop": {"strategy": "simulator", **_PACED, "step_seconds": _SECONDS, "max_steps": 8,
                                     "batched": True},
    "sync-batchnorm": {"launch": {"nodes": 1, "devices": 2, "sync_batchnorm": True}},
    "elastic-one-replica-per-trainer": {"elastic": _ELASTIC, "launch": {"nodes": 1, "devices": 2}},
    "ranks-divide-processes": {"ranks_per_replica": 3, "launch": {"nodes": 1, "devices": 4}},
    "replica-count": {"strategy": "gasloc", "topology": "exponential", "launch": {"nodes": 1, "devices": 3}},
    "paced-one-optimizer": {**_PACED, "fit": {**_PACED_FIT, "parameters": (3, 2)}},
    "paced-max-steps": {**_PACED, "fit": {**_PACED_FIT, "max_steps": -1}},
    "paced-no-max-epochs": {**_PACED, "fit": {**_PACED_FIT, "max_epochs": 3}},
    "paced-no-step-checkpoints": {**_PACED, "fit": {**_PACED_FIT, "step_checkpoints": ("ModelCheckpoint",)}},
    "paced-no-validation": {**_PACED, "fit": {**_PACED_FIT, "validates": True}},
    "elastic-one-optimizer": {"elastic": _ELASTIC, "fit": {"parameters": (3, 2)}},
    "fragments-enough-parameters": {"sync_every": 4, "fragments": 4, "fit": {"parameters": (3,)}},
    "outer-state-device": {"outer_state_device": "cuda", "fit": {"parameters": (3,)}},
    "disjoint-optimizers": {"fit": {"parameters": (3, 3), "shared_parameter": ((4,), 0, 1)}},
}


def strategy_of(example: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The strategy class and the arguments of a rule's example (its facts left out)."""
    kwargs = {k: v for k, v in example.items() if k not in ("strategy", "launch", "fit")}
    if example.get("strategy") == "simulator":
        return functools.partial(TrainingSimulator, torch.nn.Linear(1, 1), [[], []], NoLoCo()), kwargs
    return strategy_class(example.get("strategy", "noloco")), kwargs


# ---------------------------------------------------------------- the table


@pytest.mark.parametrize("rule", [r for r in RULES if r.when == "build"], ids=lambda r: r.name)
def test_each_build_rule_alone_refuses_its_example_when_the_strategy_is_built(rule):
    cls, kwargs = strategy_of(EXAMPLES[rule.name])
    with pytest.raises(RefusedOptions) as refused:
        cls(**kwargs)
    assert refused.value.rules == (rule.name,)
    assert str(refused.value) and "\n" not in str(refused.value)  # one message, the rule's own


@pytest.mark.parametrize("rule", [r for r in RULES if r.when != "build"], ids=lambda r: r.name)
def test_each_launch_and_fit_rule_alone_refuses_its_facts(rule):
    example = EXAMPLES[rule.name]
    cls, kwargs = strategy_of(example)
    options = cls(**kwargs).options  # the options themselves are fine: the facts are not
    launch = Launch(**example.get("launch", {"nodes": 1, "devices": 2}))
    fit = Fit(**example["fit"]) if "fit" in example else None
    with pytest.raises(RefusedOptions) as refused:
        check_rules(rule.when, Facts(options, launch=launch, fit=fit))
    assert refused.value.rules == (rule.name,)


@pytest.mark.parametrize("name", ["noloco", "gasloc", "diloco"])
def test_no_rule_refuses_the_defaults(name):
    options = strategy_class(name)().options
    for launch in (Launch(1, 4), Launch(2, 4), Launch(1, 1)):
        check_rules("launch", Facts(options, launch=launch))
    check_rules("fit", Facts(options, fit=Fit(parameters=(3, 2), max_steps=10, validates=True,
                                              step_checkpoints=("ModelCheckpoint",))))


def test_several_refusals_are_told_together():
    with pytest.raises(RefusedOptions) as refused:
        strategy_class("noloco")(sync_every=4, overlap_steps=4, elastic=ElasticConfig("localhost:1"))
    assert set(refused.value.rules) == {"overlap-within-round", "elastic-not-overlapped"}
    assert str(refused.value).startswith("2 options do not fit together:\n- ")


def test_rule_names_are_unique_and_each_has_its_facts():
    assert len({r.name for r in RULES}) == len(RULES)
    assert list(EXAMPLES) == [r.name for r in RULES]  # every rule has its example, in the table's order
    for r in RULES:
        if r.when == "launch":
            assert "launch" in EXAMPLES[r.name], r.name
        if r.when == "fit":
            assert "fit" in EXAMPLES[r.name], r.name


def test_docs_options_md_renders_the_table_as_it_is():
    text = (ROOT / "docs" / "options.md").read_text()
    start, end = "<!-- rules: generated from lightning_loco.rules.RULES -->", "<!-- end of rules -->"
    assert start in text and end in text
    rendered = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert rendered == rules_table(), \
        "docs/options.md is out of date: paste lightning_loco.rules.rules_table()"


# ---------------------------------------------------------------- the surface


def algorithm_arguments(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}


@pytest.mark.parametrize("name", ["noloco", "gasloc", "diloco"])
def test_every_strategy_argument_is_an_option_an_outer_step_argument_or_ddps(name):
    cls = strategy_class(name)
    shared = set(inspect.signature(OuterStepStrategy.__init__).parameters) - {"self", "algorithm", "sync_every"}
    options = {f.name for f in dataclasses.fields(Options)} - {"algorithm", "sync_every"}
    assert shared == options | DDP_ARGUMENTS
    assert len(shared) <= 25  # the shared keywords: a surface a Lightning user can hold
    algorithm = {"noloco": NoLoCo, "gasloc": GASLoC, "diloco": DiLoCo}[name]
    assert algorithm_arguments(cls) == algorithm_arguments(algorithm) | {"sync_every"}


# ---------------------------------------------------------------- every option given takes effect


H, STEPS, SPEEDS = 8, 24, (1.0, 2.0)  # three rounds of H = 8; the second replica's steps take twice as long


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(make, options: dict[str, Any]) -> Optional[list[torch.Tensor]]:
    """Two replicas pulled towards their own targets, each with its own clock, under ``options`` (a
    strategy's arguments that the driver takes); their weights at the end, or None where the rules refuse
    the options."""
    try:
        built = build_options(make(), H, **options)
    except RefusedOptions:
        return None
    network = InProcessNetwork(len(SPEEDS), timeout=30.0)
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(3, generator=g), torch.randn(2, generator=g)]  # two parameters: two fragments
    replicas = []
    for i, speed in enumerate(SPEEDS):
        clock = Clock()
        params = [torch.nn.Parameter(w.clone()) for w in start]
        targets = [torch.randn(w.shape, generator=torch.Generator().manual_seed(10 + i)) for w in start]
        driver = OuterStepDriver(built, network.transport(i), clock=clock)
        driver.add(FlatParameters(params, torch.device("cpu")))
        if driver.pacing is not None:
            driver.pacing.end_at(STEPS)
        replicas.append((driver, clock, speed, params, targets))

    def train(driver, clock, speed, params, targets) -> None:
        for _ in range(STEPS):
            clock.now += speed
            with torch.no_grad():
                for p, target in zip(params, targets):
                    p.sub_(0.2 * (p - target))
            last = driver.last_step(0, STEPS)
            driver.after_inner_step(0, last=last)
            if last:
                break
        driver.land_all()

    run_in_threads([functools.partial(train, *r) for r in replicas])
    return [torch.cat([p.detach().reshape(-1) for p in r[3]]) for r in replicas]


def values(make) -> dict[str, list[Any]]:
    """A non-default value of every option the driver takes (error feedback: the opposite of the algorithm's
    own default)."""
    feedback = not make().payload_is_pseudo_gradient
    return {
        "overlap_steps": [2, "auto"],
        "overlap_merge": ["delayed"],
        "fragments": [2],
        "pacing": [PacingConfig(H * 1.0), PacingConfig(H * 1.0, merge="steps")],
        "wire": ["bfloat16", WireConfig("int8", block_size=2, error_feedback=feedback)],
        "final_outer_step": ["outer"],
    }


def label(value: Any) -> str:
    return str(value).replace("WireConfig", "").replace("PacingConfig", "pacing")


def pairs(make) -> list[tuple[tuple[str, Any], tuple[str, Any]]]:
    options = values(make)
    singles = [(name, v) for name, vs in options.items() for v in vs]
    return [(a, b) for a, b in itertools.combinations(singles, 2) if a[0] != b[0]]


ALGORITHMS = {"noloco": NoLoCo, "diloco": DiLoCo, "gasloc": GASLoC}
CASES = [(name, a, b) for name, make in ALGORITHMS.items() for a, b in pairs(make)]


RUNS: dict[tuple[str, str], Optional[list[torch.Tensor]]] = {}  # each run once per worker process


def run_once(name: str, options: dict[str, Any]) -> Optional[list[torch.Tensor]]:
    key = (name, repr(sorted((k, repr(v)) for k, v in options.items())))
    if key not in RUNS:
        RUNS[key] = run(ALGORITHMS[name], options)
    return RUNS[key]


def differs(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(x, y))


@pytest.mark.parametrize("name,a,b", CASES, ids=[f"{n}-{a[0]}={label(a[1])}-{b[0]}={label(b[1])}" for n, a, b in CASES])
def test_every_option_takes_effect_in_every_combination_the_rules_let_through(name, a, b):
    both = run_once(name, dict([a, b]))
    if both is None:
        return  # refused: the rules say so (tests above prove each refusal)
    only_a, only_b = run_once(name, dict([a])), run_once(name, dict([b]))
    assert only_a is not None or only_b is not None
    if only_b is not None:
        assert differs(both, only_b), f"{a} is ignored beside {b}"
    if only_a is not None:
        assert differs(both, only_a), f"{b} is ignored beside {a}"


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_option_takes_effect_alone(name):
    plain = run_once(name, {})
    assert plain is not None
    for option, given in values(ALGORITHMS[name]).items():
        for value in given:
            alone = run_once(name, {option: value})
            if alone is not None:  # overlap_merge alone is refused (merge-needs-overlap)
                assert differs(alone, plain), (option, value)


# ---------------------------------------------------------------- the papers' defaults, written once


def test_each_paper_default_is_written_once_in_the_library():
    """algorithms/defaults.py writes each default of NoLoCo, DiLoCo and GASLoC; no other module of the algorithms,
    the strategies (Trainer and Fabric), the rules or the simulator writes one again as a literal: not as a
    parameter's default of that name, not in a message of ``check_positive`` or ``check_momentum``, not compared
    with an attribute of that name (a number or a flag)."""
    import ast

    from lightning_loco.algorithms.defaults import DILOCO, GASLOC, NOLOCO

    paper = {(n, type(v), v) for c in (NOLOCO, DILOCO, GASLOC) for n, v in c._asdict().items() if v is not None}
    package = ROOT / "lightning_loco"
    found: list[str] = []
    for folder in ("algorithms", "trainer", "fabric", "replica", "rules", "simulator"):
        for path in sorted((package / folder).glob("*.py")):
            if path.name == "defaults.py" or path.relative_to(package).as_posix() == "simulator/data.py":
                continue  # the defaults themselves; the data's seed=0 is DistributedSampler's, not an algorithm's
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                pairs: list[tuple[str, ast.expr]] = []
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # a parameter's default
                    args = node.args.posonlyargs + node.args.args
                    pairs += list(zip([a.arg for a in args[len(args) - len(node.args.defaults):]], node.args.defaults))
                    pairs += [(a.arg, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
                elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("check_positive", "check_momentum"):
                    name = ast.literal_eval(node.args[0]).split(" ")[0]  # the default a message names
                    pairs += [(name, a) for a in node.args[2:]]
                elif isinstance(node, ast.Compare):  # an argument compared with a numeric default
                    sides = [node.left, *node.comparators]
                    attrs = [s.attr for s in sides if isinstance(s, ast.Attribute)]
                    literal = [s for s in sides if isinstance(s, (ast.Constant, ast.Tuple))]
                    pairs += [(a, s) for a in attrs for s in literal if not isinstance(getattr(s, "value", 0), str)]
                for name, value in pairs:
                    literals = value.elts if isinstance(value, ast.Tuple) else [value]
                    if any(isinstance(v, ast.Constant) and (name, type(v.value), v.value) in paper for v in literals):
                        found.append(f"{path.relative_to(ROOT)}:{value.lineno}: {name}={ast.unparse(value)}")
    assert found == [], "a paper default written again (read it from lightning_loco.algorithms.defaults):\n" + \
        "\n".join(found)
    defaults = (ROOT / "lightning_loco" / "algorithms" / "defaults.py").read_text()
    for constant in (NOLOCO, DILOCO, GASLOC):
        for name, value in constant._asdict().items():  # each written once, in its class
            written = f'"{value}"' if isinstance(value, str) else repr(value)
            lines = re.findall(rf"^    {name}: [^=\n]+= {re.escape(written)}(?:  #.*)?$", defaults, re.M)
            assert len(lines) == sum(name in c._fields and c._asdict()[name] == value for c in (NOLOCO, DILOCO, GASLOC))


def test_the_driver_imports_no_rule():
    from test_package_layout import imports, modules

    known = modules()
    seen, todo = set(), ["lightning_loco.driver.driver"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += imports(name, known[name], known)[0]
    assert not {m for m in seen if m.startswith("lightning_loco.rules")}, sorted(seen)


def test_disjoint_optimizers_fires_for_a_fabric_loop_from_its_optimizers():
    from lightning_loco.fabric.strategy import _fit

    shared = torch.nn.Parameter(torch.zeros(4))
    optimizers = [torch.optim.SGD([shared, torch.nn.Parameter(torch.zeros(2))], lr=1), torch.optim.SGD([shared], lr=1)]
    fit = _fit(optimizers, None, torch.device("cpu"))
    assert fit.shared_parameter == ((4,), 0, 1)
    with pytest.raises(RefusedOptions) as refused:
        check_rules("fit", Facts(strategy_class("fabric:noloco")().options, fit=fit, loop="fabric"))
    assert refused.value.rules == ("disjoint-optimizers",)
