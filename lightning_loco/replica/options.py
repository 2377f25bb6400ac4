"""The options of a run, grouped as a user sets them, and the one table of rules that says which
combinations run.

A strategy takes a handful of flat arguments that everyone tunes (``sync_every``, the outer step's
learning rate and momentum, ``overlap_steps``, ``fragments``, ``ranks_per_replica``) and one object
per mode that has a vocabulary of its own:

* ``wire=``: how payloads travel, a format name (``"bfloat16"``, ``"int8"``, ...) or a
  :class:`WireConfig` (int8's block size, error feedback);
* ``pacing=``: replicas of different speeds, a number of seconds or a :class:`PacingConfig`;
* ``replica_sharding=``: FSDP2 inside a replica, ``"fsdp"`` or an :class:`FSDPConfig`;
* ``elastic=``: replicas that come and go, an :class:`~lightning_loco.elastic.config.ElasticConfig`.

:class:`Options` holds all of them for one run (the Lightning strategies, the Fabric strategies and the
simulator build one, and the driver reads it). Each option checks its own value when it is built;
every combination that cannot run is refused by one :class:`Rule` of :data:`RULES`, the table
``docs/options.md`` renders. A rule is checked as soon as the facts it needs exist:

* ``build``: when the options (the strategy) are built, from the options alone;
* ``launch``: when the Trainer is built and the number of processes is known, before any starts;
* ``fit``: when ``fit`` starts, in one place, once the model and its optimizers are known.

Whatever no rule refuses runs, and every option given takes effect: an option that only applies with
another one is refused without it (``tests/test_options.py`` proves both).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Optional, Union

import torch

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.algorithms.diloco import DiLoCo
from lightning_loco.algorithms.gasloc import GASLoC
from lightning_loco.algorithms.outer_optimizer import picklable_problem
from lightning_loco.driver.fragments import too_few_parameters
from lightning_loco.driver.overlap import MERGES as OVERLAP_MERGES
from lightning_loco.driver.overlap import OverlapSteps, check_overlap_steps
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.wire.codecs import DEFAULT_BLOCK_SIZE, FORMATS, WireFormat, make_codec

WireFormatName = Literal["float32", "bfloat16", "float16", "int8"]
Block = Union[type, str]
FINAL_OUTER_STEPS = ("average", "outer")
PACING_MERGES = ("mean", "steps")
START_METHODS = ("popen", "spawn", "fork", "forkserver")


def check_int(name: str, value: Any, advice: str) -> None:
    """Raises ``ValueError`` unless ``value`` is an integer >= 1 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}. {advice}")


def _check_bool(name: str, value: Any, advice: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}. {advice}")


# ---------------------------------------------------------------- the option groups


@dataclass(frozen=True)
class WireConfig:
    """How the outer step's payloads travel between replicas (docs/compression.md). The outer state
    stays float32 and receivers decode and sum in float32 whatever the format.

    Args:
        format: "float32" (default: payloads as they are), "bfloat16" or "float16" (half the bytes;
            float16 keeps 3 more bits but carries no |x| > 65504), or "int8" (each block of
            ``block_size`` values as int8 with one float32 scale: about a quarter of the bytes).
        block_size: int8 only: values per scale, an integer >= 1 (None: 256, where 1.6 % of the bytes
            are scales; smaller blocks follow outliers more closely).
        error_feedback: lossy formats only: keep what the codec lost of each payload and add it to the
            next (saved in checkpoints). None (default): on where the payload is a pseudo-gradient
            (DiLoCo), off where it is weights (NoLoCo, GASLoC), as docs/compression.md measured.
        streams: connections per pair of replicas, an integer >= 1 (default 1). s > 1 cuts every exchange
            and all-reduce into s pieces, each over a process group of its own (gloo opens a connection per
            group), for a long fat pipe, where one TCP connection carries at most its send buffer per
            round trip (docs/launching.md). A pair exchange's sums are bitwise those of one stream; an
            all-reduce's (DiLoCo) may differ in the last bit with 3 or more replicas (gloo picks each
            piece's order of additions). Replicas of one rank, on the strategies' own transport (not with
            ``elastic`` or a ``transport_factory``).
    """

    format: WireFormatName = "float32"
    block_size: Optional[int] = None
    error_feedback: Optional[bool] = None
    streams: int = 1

    def check(self) -> None:
        """Raises ``ValueError`` naming a field that holds no value it can take (checked with the options)."""
        if self.format not in FORMATS:
            raise ValueError(
                f"wire format must be one of {', '.join(map(repr, FORMATS))}, got {self.format!r}. 'float32' (the "
                "default) sends payloads as they are; 'bfloat16' and 'float16' halve the bytes; 'int8' quarters them."
            )
        if self.block_size is not None:
            check_int("wire block_size", self.block_size,
                      f"The default, {DEFAULT_BLOCK_SIZE}, spends 4 bytes of scale per {DEFAULT_BLOCK_SIZE} values "
                      "(1.6 % on top of int8); smaller blocks follow outliers more closely for more scale bytes.")
        if self.error_feedback is not None:
            _check_bool("wire error_feedback", self.error_feedback,
                        "None (the default) turns it on for pseudo-gradient payloads (DiLoCo) with a lossy format.")
        check_int("wire streams", self.streams,
                  "1 (the default) sends each exchange over one connection per pair; s > 1 over s of them.")

    @property
    def lossy(self) -> bool:
        return self.format != "float32"

    def resolve(self, pseudo_gradient: bool) -> WireFormat:
        """The codec and the error feedback of a run whose payloads are pseudo-gradients (or weights)."""
        codec = make_codec(self.format, self.block_size or DEFAULT_BLOCK_SIZE)
        feedback = pseudo_gradient if self.error_feedback is None else self.error_feedback
        return WireFormat(codec, feedback and codec.lossy)


@dataclass(frozen=True)
class PacingConfig:
    """Replicas of different speeds (docs/heterogeneous.md): each replica takes its own number of
    inner steps per round, H_i, so that nobody waits for a slower one.

    Args:
        sync_seconds: T: a replica posts its next round once its inner phase is as near T seconds of
            compute on its own clock (the waits at exchanges left out) as its steps allow, after at
            least one inner step and at most ``sync_every``. About ``sync_every`` × the fastest
            replica's step time paces every replica; ``"auto"`` sets T to that from the replicas'
            measured step times, again at every round (the first round is ``sync_every`` steps
            everywhere). The run is then ⌈max_steps / sync_every⌉ rounds on every replica
            (``max_steps`` is required, in nominal steps), and each replica's ``global_step`` is its
            own optimizer steps.
        merge: how a group combines payloads of unequal H_i: "mean" (default: the plain mean) or
            "steps" (each replica weighted by its H_i, which travels with the payload; NoLoCo and
            DiLoCo, float32 wire only).
    """

    sync_seconds: Union[float, Literal["auto"]]
    merge: Literal["mean", "steps"] = "mean"

    def check(self) -> None:
        """Raises ``ValueError`` naming a field that holds no value it can take (checked with the options)."""
        value = self.sync_seconds
        if value == "auto":
            pass
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"sync_seconds must be a number of seconds > 0 or 'auto', got {value!r}. At most sync_every × the "
                "fastest replica's step time paces every replica; pacing=None (the default) gives every replica "
                "sync_every inner steps per round."
            )
        if self.merge not in PACING_MERGES:
            raise ValueError(
                f"merge must be 'mean' (the default: the plain mean of the group's payloads) or 'steps' (each "
                f"replica's payload weighted by its inner steps H_i), got {self.merge!r}."
            )


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 inside each replica (docs/launching.md), for a module that shards nothing itself in
    ``configure_model``.

    Args:
        blocks: the module classes (or class names) sharded one unit each, e.g. ``(TransformerBlock,)``
            (default (): each direct child of the LightningModule that holds parameters is one unit).
        kwargs: keyword arguments of the automatic policy's ``fully_shard`` calls, e.g.
            ``{"reshard_after_forward": False}`` or an ``mp_policy`` (the outer state stays float32).
    """

    blocks: Sequence[Block] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks or ()))
        object.__setattr__(self, "kwargs", dict(self.kwargs or {}))

    def check(self) -> None:
        """Raises ``ValueError`` naming a field that holds no value it can take (checked with the options)."""
        from torch import nn

        blocks = self.blocks
        bad = [b for b in blocks if not (isinstance(b, str) or (isinstance(b, type) and issubclass(b, nn.Module)))]
        if bad:
            raise ValueError(
                f"FSDP blocks must be nn.Module classes or class names, got {bad!r}; e.g. "
                "FSDPConfig(blocks=(MyBlock,)) or blocks=('MyBlock',)."
            )
        if "mesh" in self.kwargs:
            raise ValueError(
                "FSDP kwargs must not hold 'mesh': every replica shards over its own ranks "
                "(self.device_mesh['data_parallel']). Remove it."
            )


def wire_config(wire: Union[str, WireConfig, None]) -> WireConfig:
    """A ``wire=`` argument as a :class:`WireConfig` (a format name stands for its defaults)."""
    if isinstance(wire, WireConfig):
        return wire
    if wire is None or isinstance(wire, str):
        return WireConfig(format=wire or "float32")  # type: ignore[arg-type]  # WireConfig.check: the name
    raise ValueError(f"wire must be a format name ({', '.join(map(repr, FORMATS))}) or a WireConfig, got {wire!r}.")


def pacing_config(pacing: Union[None, float, str, PacingConfig]) -> Optional[PacingConfig]:
    """A ``pacing=`` argument as a :class:`PacingConfig` (a number or "auto" stands for ``sync_seconds``)."""
    if pacing is None or isinstance(pacing, PacingConfig):
        return pacing
    return PacingConfig(sync_seconds=pacing)  # type: ignore[arg-type]  # checked with the options


def sharding_config(replica_sharding: Union[None, str, FSDPConfig]) -> Optional[FSDPConfig]:
    """A ``replica_sharding=`` argument as an :class:`FSDPConfig` (``"fsdp"`` stands for its defaults)."""
    if replica_sharding is None or isinstance(replica_sharding, FSDPConfig):
        return replica_sharding
    if replica_sharding == "fsdp":
        return FSDPConfig()
    raise ValueError(
        f"replica_sharding must be None (every rank of a replica holds the whole model, DDP inside), 'fsdp' (FSDP2 "
        f"shards it over the replica's ranks) or an FSDPConfig, got {replica_sharding!r}."
    )


def device_option(value: Any) -> Optional[torch.device]:
    try:
        return None if value is None else torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"outer_state_device={value!r} is not a device torch knows. Use None (the model's device) "
            "or 'cpu' (keeps the float32 outer state off the accelerator)."
        ) from err


@dataclass(frozen=True)
class Options:
    """Every option of one run, each checked, and the rules of :data:`RULES` checked over them when
    built (``ValueError`` naming what to do instead). The strategies' arguments of the same names;
    ``algorithm`` is the outer step they build."""

    algorithm: OuterAlgorithm
    sync_every: int
    overlap_steps: OverlapSteps = 0
    overlap_merge: str = "predict_correct"
    fragments: int = 1
    pacing: Optional[PacingConfig] = None
    ranks_per_replica: int = 1
    replica_sharding: Optional[FSDPConfig] = None
    average_at_end: Optional[bool] = None
    final_outer_step: str = "average"
    wire: WireConfig = field(default_factory=WireConfig)
    outer_state_device: Optional[torch.device] = None
    transport_factory: Optional[Callable[..., Any]] = None
    elastic: Optional[ElasticConfig] = None
    start_method: str = "popen"

    @classmethod
    def build(cls, algorithm: OuterAlgorithm, sync_every: int, *,
              pacing: Union[None, float, str, PacingConfig] = None,
              replica_sharding: Union[None, str, FSDPConfig] = None, wire: Union[None, str, WireConfig] = None,
              outer_state_device: Any = None, **others: Any) -> Options:
        """The options from a strategy's arguments, in any of their forms: a number of seconds for
        ``pacing``, ``"fsdp"`` for ``replica_sharding``, a format name for ``wire``, a device name."""
        return cls(algorithm=algorithm, sync_every=sync_every, pacing=pacing_config(pacing),
                   replica_sharding=sharding_config(replica_sharding), wire=wire_config(wire),
                   outer_state_device=device_option(outer_state_device), **others)

    def __post_init__(self) -> None:
        check_int("sync_every (H)", self.sync_every, "It counts inner optimizer steps between outer steps.")
        check_overlap_steps(self.overlap_steps)
        if self.overlap_merge not in OVERLAP_MERGES:
            raise ValueError(
                f"overlap_merge must be 'predict_correct' (the default: start from the local prediction, correct "
                f"at the landing) or 'delayed' (apply the outer step late), got {self.overlap_merge!r}."
            )
        check_int("fragments", self.fragments, "1 (the default) sends the whole model at each outer step; F > 1 "
                  "sends one fragment of it every sync_every / F inner steps.")
        check_int("ranks_per_replica", self.ranks_per_replica, "1 (the default) makes every process a replica; the "
                  "number of devices per node makes every node one replica.")
        for name, kind in (("pacing", PacingConfig), ("replica_sharding", FSDPConfig), ("wire", WireConfig),
                           ("outer_state_device", torch.device)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"Options.{name} must be a {kind.__name__} (Options.build takes its other forms), "
                                f"got {value!r}")
            if value is not None and hasattr(value, "check"):
                value.check()
        if self.average_at_end is not None:
            _check_bool("average_at_end", self.average_at_end,
                        "None (the default) averages the replicas at the end of fit, except for elastic replicas.")
        if self.final_outer_step not in FINAL_OUTER_STEPS:
            raise ValueError(
                f"final_outer_step must be 'average' (the round that ends training lands without the outer step's "
                f"momentum extrapolation) or 'outer' (the papers' plain outer step), got {self.final_outer_step!r}."
            )
        if self.elastic is not None:
            if not isinstance(self.elastic, ElasticConfig):
                raise ValueError(f"elastic must be None or an ElasticConfig(lighthouse=HOST:PORT, ...), got "
                                 f"{self.elastic!r}.")
            self.elastic.check()
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(map(repr, START_METHODS))}, "
                             f"got {self.start_method!r}.")
        check_rules("build", Facts(self))

    @property
    def wire_format(self) -> WireFormat:
        """The resolved wire format: its codec and whether this run keeps an error-feedback residual."""
        return self.wire.resolve(self.algorithm.payload_is_pseudo_gradient)

    @property
    def averages_at_end(self) -> bool:
        """Whether ``fit`` ends with every replica set to the replicas' average (None: yes, except elastic)."""
        return self.elastic is None if self.average_at_end is None else self.average_at_end

    @property
    def sync_seconds(self) -> Union[None, float, str]:
        """T in seconds, "auto", or None (no pacing)."""
        if self.pacing is None:
            return None
        return "auto" if self.pacing.sync_seconds == "auto" else float(self.pacing.sync_seconds)

    @property
    def pacing_text(self) -> str:
        """How messages name the pacing: ``sync_seconds=2`` or ``sync_seconds='auto'``."""
        if self.pacing is None:
            return ""
        t = self.pacing.sync_seconds
        return f"sync_seconds={t!r}" if isinstance(t, str) else f"sync_seconds={t:g}"

    @property
    def merge(self) -> str:
        return "mean" if self.pacing is None else self.pacing.merge

    def but(self, **changes: Any) -> Options:
        """These options with ``changes`` (checked again)."""
        return replace(self, **changes)


OPTION_NAMES = tuple(f.name for f in fields(Options))
GROUPS: dict[str, type] = {"wire": WireConfig, "pacing": PacingConfig, "replica_sharding": FSDPConfig,
                           "elastic": ElasticConfig}  # the options that are objects of their own


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
class Facts:
    """What a rule may look at: the options, and what the launch and the fit add once known."""

    options: Options
    launch: Optional[Launch] = None
    fit: Optional[Fit] = None
    loop: Literal["trainer", "fabric"] = "trainer"  # whose training loop: Lightning's Trainer, or a Fabric loop


# ---------------------------------------------------------------- the table of rules


class RefusedOptions(ValueError):
    """Options that cannot run together: the message says what to do instead; ``rules`` names the rules of
    :data:`RULES` that refused them."""

    def __init__(self, message: str, rules: Sequence[str]) -> None:
        super().__init__(message)
        self.rules = tuple(rules)


@dataclass(frozen=True)
class Rule:
    """One combination that cannot run. ``check(facts)`` returns what the user is told (the message
    says what to do instead), or None where the facts are fine. ``refuses`` and ``instead`` are the
    docs table's words. ``example``, for the tests: a strategy's arguments (``"strategy"``: its name,
    default NoLoCo's) that this rule alone refuses, and for a launch or fit rule the facts that make it
    refuse them (``"launch"``: :class:`Launch`'s fields; ``"fit"``: :class:`Fit`'s)."""

    name: str
    when: Literal["build", "launch", "fit"]
    options: tuple[str, ...]
    refuses: str
    instead: str
    check: Callable[[Facts], Optional[str]]
    example: Optional[dict[str, Any]] = None


RULES: list[Rule] = []
_ELASTIC = ElasticConfig("localhost:29510", replica_id="example")  # the examples' elastic replica
_ADAM = functools.partial(torch.optim.Adam, lr=1e-3)  # the examples' outer optimizer


def rule(name: str, when: Literal["build", "launch", "fit"], options: tuple[str, ...], refuses: str, instead: str,
         example: Optional[dict[str, Any]] = None) -> Callable[[Callable[[Facts], Optional[str]]], Rule]:
    """Adds the decorated check to :data:`RULES` (the order of the table)."""

    def add(check: Callable[[Facts], Optional[str]]) -> Rule:
        made = Rule(name, when, options, refuses, instead, check, example)
        RULES.append(made)
        return made

    return add


def check_rules(when: str, facts: Facts) -> None:
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


def _int_overlap(o: Options) -> Optional[int]:
    return o.overlap_steps if isinstance(o.overlap_steps, int) and not isinstance(o.overlap_steps, bool) else None


# -- overlap and fragments


@rule("overlap-within-round", "build", ("overlap_steps", "sync_every"),
      "`overlap_steps` ≥ `sync_every`", "τ < H (a round lands before the next starts), or `'auto'`",
      example={"sync_every": 4, "overlap_steps": 4})
def _overlap_within_round(f: Facts) -> Optional[str]:
    o, tau = f.options, _int_overlap(f.options)
    if tau is None or tau < o.sync_every:
        return None
    return (f"overlap_steps={tau} must be smaller than sync_every={o.sync_every}: a round must land before the next "
            f"one starts. Use at most {o.sync_every - 1}, or 'auto'.")


@rule("merge-needs-overlap", "build", ("overlap_merge", "overlap_steps"),
      "`overlap_merge='delayed'` with `overlap_steps=0`", "`overlap_steps` > 0 or `'auto'`, or the default merge",
      example={"overlap_merge": "delayed"})
def _merge_needs_overlap(f: Facts) -> Optional[str]:
    o = f.options
    if o.overlap_merge == "predict_correct" or o.overlap_steps != 0:
        return None
    return (f"overlap_merge={o.overlap_merge!r} merges an overlapped round at its landing, and overlap_steps=0 "
            "overlaps nothing. Set overlap_steps (e.g. 'auto'), or leave overlap_merge at 'predict_correct'.")


@rule("fragments-divide-sync-every", "build", ("fragments", "sync_every"),
      "`sync_every` not a multiple of `fragments`", "a divisor of H", example={"sync_every": 6, "fragments": 4})
def _fragments_divide(f: Facts) -> Optional[str]:
    o = f.options
    if o.sync_every % o.fragments == 0:
        return None
    divisors = [d for d in range(1, o.sync_every + 1) if o.sync_every % d == 0]
    return (f"fragments={o.fragments} must divide sync_every={o.sync_every}, so that one fragment's round starts "
            f"every sync_every / fragments inner steps. Use one of {divisors}, or change sync_every.")


@rule("overlap-within-fragment", "build", ("overlap_steps", "fragments", "sync_every"),
      "`overlap_steps` ≥ `sync_every / fragments`", "τ < H/F, fewer fragments, or `'auto'`",
      example={"sync_every": 6, "fragments": 2, "overlap_steps": 3})
def _overlap_within_fragment(f: Facts) -> Optional[str]:
    o, tau = f.options, _int_overlap(f.options)
    if o.fragments == 1 or o.sync_every % o.fragments or tau is None:
        return None
    stride = o.sync_every // o.fragments
    if tau < stride or tau >= o.sync_every:  # the latter: overlap-within-round says it
        return None
    return (f"overlap_steps={tau} must be smaller than sync_every / fragments = {stride} with fragments={o.fragments}: "
            f"a fragment's round must land before the next fragment's starts. Use at most {stride - 1}, fewer "
            "fragments, or 'auto'.")


def _fragments_with(what: str, present: Callable[[Options], bool], name: str, example: dict[str, Any]) -> None:
    @rule(name, "build", ("fragments", what.split(" ")[0]), f"`fragments` > 1 with {what}",
          "`fragments=1` with it", example={"sync_every": 4, "fragments": 2, **example})
    def _check(f: Facts) -> Optional[str]:
        o = f.options
        if o.fragments == 1 or not present(o):
            return None
        return (f"fragments={o.fragments} does not work with {what} yet. Use fragments=1 with it, or leave it out "
                "to train with fragments.")


_fragments_with("pacing (replicas of different speeds post after their own number of steps)",
                lambda o: o.pacing is not None, "fragments-not-paced", {"pacing": 1.0})
_fragments_with("elastic replicas", lambda o: o.elastic is not None, "fragments-not-elastic",
                {"elastic": _ELASTIC})
_fragments_with("replica_sharding (FSDP2 inside a replica)", lambda o: o.replica_sharding is not None,
                "fragments-not-sharded", {"replica_sharding": "fsdp"})


# -- pacing


@rule("pacing-not-overlapped", "build", ("pacing", "overlap_steps"),
      "`pacing` with `overlap_steps` ≠ 0", "`overlap_steps=0` with pacing",
      example={"pacing": 1.0, "overlap_steps": 2})
def _pacing_not_overlapped(f: Facts) -> Optional[str]:
    o = f.options
    if o.pacing is None or o.overlap_steps == 0:
        return None
    return (f"pacing ({o.pacing_text}) and overlap_steps={o.overlap_steps!r} cannot be combined "
            "yet: a round that lands a number of inner steps after its start would land at a different time on every "
            "replica. Use overlap_steps=0 with pacing, or pacing=None to overlap.")


@rule("auto-pacing-one-rank", "build", ("pacing", "ranks_per_replica"),
      "`sync_seconds='auto'` with `ranks_per_replica` > 1", "T in seconds with several ranks per replica",
      example={"pacing": "auto", "ranks_per_replica": 2})
def _auto_pacing_one_rank(f: Facts) -> Optional[str]:
    o = f.options
    if o.sync_seconds != "auto" or o.ranks_per_replica == 1:
        return None
    return (f"pacing (sync_seconds='auto') with ranks_per_replica={o.ranks_per_replica} cannot be combined yet: the "
            "ranks of a replica would read the replicas' step times at different moments and could choose different "
            "T. Give T in seconds (about sync_every × the fastest replica's step time), or use one rank per replica.")


@rule("steps-merge-algorithm", "build", ("pacing.merge", "algorithm"),
      "`merge='steps'` with an algorithm whose mix must keep the mean (GASLoC)", "NoLoCo or DiLoCo, or `merge='mean'`",
      example={"strategy": "gasloc", "pacing": PacingConfig(1.0, merge="steps")})
def _steps_merge_algorithm(f: Facts) -> Optional[str]:
    o = f.options
    if o.merge != "steps" or o.algorithm.step_weighting:
        return None
    return (f"merge='steps' does not serve {o.algorithm.name}: its gossip mix must stay mean-preserving (the mean "
            "over replicas follows Nesterov DiLoCo), and a mix weighted by steps moves that mean towards the faster "
            "replica. Use merge='mean' with it, or NoLoCo or DiLoCo with merge='steps'.")


@rule("steps-merge-exact-wire", "build", ("pacing.merge", "wire"),
      "`merge='steps'` with a lossy wire format", "`wire='float32'`, or `merge='mean'`",
      example={"pacing": PacingConfig(1.0, merge="steps"), "wire": "bfloat16"})
def _steps_merge_exact_wire(f: Facts) -> Optional[str]:
    o = f.options
    if o.merge != "steps" or not o.wire.lossy:
        return None
    return (f"merge='steps' sends each replica's H_i with its payload, and a lossy wire format "
            f"(wire={o.wire.format!r}) would round it. Use wire='float32' with merge='steps', or merge='mean' to keep "
            "the lossy format.")


# -- the wire format


@rule("block-size-int8-only", "build", ("wire.block_size", "wire.format"),
      "`block_size` with a format other than int8", "`format='int8'`, or no block size",
      example={"wire": WireConfig("bfloat16", block_size=64)})
def _block_size_int8_only(f: Facts) -> Optional[str]:
    w = f.options.wire
    if w.block_size is None or w.format == "int8":
        return None
    return (f"wire block_size={w.block_size} sets int8's values per scale, and the format is {w.format!r}. Use "
            "format='int8' with it, or leave block_size out.")


@rule("error-feedback-lossy-only", "build", ("wire.error_feedback", "wire.format"),
      "`error_feedback` set with the float32 format", "a lossy format, or no error_feedback",
      example={"wire": WireConfig("float32", error_feedback=True)})
def _error_feedback_lossy_only(f: Facts) -> Optional[str]:
    w = f.options.wire
    if w.error_feedback is None or w.lossy:
        return None
    return (f"wire error_feedback={w.error_feedback} keeps what a lossy codec loses, and float32 loses nothing. Use a "
            "lossy format (e.g. wire={'format': 'int8', 'error_feedback': True}), or leave error_feedback out.")


# -- launching


@rule("outer-optimizer-pickles", "build", ("algorithm.outer_optimizer", "start_method"),
      "an `outer_optimizer` that does not pickle with `start_method` 'spawn' or 'forkserver'",
      "a module-level function or `functools.partial`, or 'popen'",
      example={"strategy": "diloco", "start_method": "spawn", "outer_optimizer": lambda p: torch.optim.SGD(p, lr=1)})
def _outer_optimizer_pickles(f: Facts) -> Optional[str]:
    o = f.options
    return picklable_problem(getattr(o.algorithm, "outer_optimizer", None), o.start_method)


@rule("sharded-launch", "build", ("replica_sharding", "start_method"),
      "`replica_sharding` with `start_method` other than 'popen'", "'popen' (torchrun and SLURM launch alike)",
      example={"replica_sharding": "fsdp", "start_method": "spawn"})
def _sharded_launch(f: Facts) -> Optional[str]:
    o = f.options
    if o.replica_sharding is None or o.start_method == "popen":
        return None
    return (f"replica_sharding='fsdp' with start_method={o.start_method!r}: a sharded model cannot be handed back to "
            "the launching process as a whole (Lightning's sharded strategies launch the same way). Use "
            "start_method='popen' (the default; torchrun and SLURM launch alike).")


# -- elastic replicas


@rule("elastic-not-overlapped", "build", ("elastic", "overlap_steps"),
      "`elastic` with `overlap_steps` ≠ 0", "`overlap_steps=0`",
      example={"elastic": _ELASTIC, "overlap_steps": 2})
def _elastic_not_overlapped(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.overlap_steps == 0:
        return None
    return (f"overlap_steps={o.overlap_steps!r} with elastic replicas: elastic mode switches memberships and heals "
            "joiners between rounds, where an overlapped round would still be in flight (with partners that may have "
            "left, and a state no joiner can take half-sent). Use overlap_steps=0 (the default).")


@rule("elastic-collective-lossy-ranks", "build", ("elastic", "ranks_per_replica", "wire", "algorithm"),
      "`elastic` with `ranks_per_replica` > 1, a lossy wire and a collective algorithm (DiLoCo)",
      "the float32 wire, or one rank per replica",
      example={"strategy": "diloco", "elastic": _ELASTIC, "ranks_per_replica": 2,
               "wire": "int8"})
def _elastic_collective_lossy_ranks(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.ranks_per_replica == 1 or not o.wire.lossy or not o.algorithm.collective:
        return None
    return (f"ranks_per_replica={o.ranks_per_replica} with elastic replicas and a lossy wire format "
            f"(wire={o.wire.format!r}): a collective round's lossy all-reduce takes a second exchange after its ranks "
            "agreed on the round, which a replica of several ranks cannot yet undo on one rank alone. Use the float32 "
            "wire format, or one rank per replica.")


@rule("elastic-any-replica-count", "build", ("elastic", "algorithm"),
      "`elastic` with a schedule for a fixed number of replicas (`topology='exponential'`)",
      "`topology='random_pairs'` or `'ring'`",
      example={"strategy": "gasloc", "topology": "exponential", "elastic": _ELASTIC})
def _elastic_any_replica_count(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.algorithm.any_replica_count:
        return None
    return ("topology='exponential' with elastic replicas: it needs a power-of-two number of replicas, and the number "
            "of live replicas changes. Use topology='random_pairs' (the default) or 'ring'.")


@rule("elastic-not-paced", "build", ("elastic", "pacing"), "`elastic` with `pacing`", "one of them",
      example={"elastic": _ELASTIC, "pacing": 1.0})
def _elastic_not_paced(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.pacing is None:
        return None
    return (f"pacing ({o.pacing_text}) and elastic replicas cannot be combined yet: a replica "
            "that heals takes a donor's step counts. Use pacing=None with elastic replicas, or the static launch.")


@rule("elastic-own-transport", "build", ("elastic", "transport_factory"), "`elastic` with `transport_factory`",
      "one of them", example={"elastic": _ELASTIC, "transport_factory": lambda **kw: None})
def _elastic_own_transport(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.transport_factory is None:
        return None
    return ("transport_factory and elastic replicas are exclusive: elastic replicas bring their own transport (over "
            "the live members). Pass one of them.")


@rule("streams-one-rank-per-replica", "build", ("wire.streams", "ranks_per_replica"),
      "`wire.streams` > 1 with `ranks_per_replica` > 1", "`wire.streams=1` with replicas of several ranks",
      example={"wire": WireConfig(streams=4), "ranks_per_replica": 2})
def _streams_one_rank(f: Facts) -> Optional[str]:
    o = f.options
    if o.wire.streams == 1 or o.ranks_per_replica == 1:
        return None
    return (f"wire.streams={o.wire.streams} with ranks_per_replica={o.ranks_per_replica}: a replica of several ranks "
            "already spreads its exchange over its ranks' own connections (rank j sends slice j), and the streams "
            "would multiply every rank's groups. Use wire.streams=1 with replicas of several ranks.")


@rule("streams-own-transport", "build", ("wire.streams", "elastic", "transport_factory"),
      "`wire.streams` > 1 with `elastic` or a `transport_factory`",
      "`wire.streams=1` (give the streams to your own transport)",
      example={"wire": WireConfig(streams=4), "transport_factory": lambda **kw: None})
def _streams_own_transport(f: Facts) -> Optional[str]:
    o = f.options
    if o.wire.streams == 1 or (o.elastic is None and o.transport_factory is None):
        return None
    whose = "elastic replicas' transport (over the live members)" if o.elastic is not None else "a transport_factory"
    return (f"wire.streams={o.wire.streams} is an option of the strategies' own torch.distributed transport, not of "
            f"{whose}. Use wire.streams=1 there (a factory of your own can take streams itself, e.g. "
            "functools.partial(TorchDistributedTransport, streams=4)).")


@rule("elastic-no-average-at-end", "build", ("elastic", "average_at_end"), "`elastic` with `average_at_end=True`",
      "`average_at_end=None` (or False): each replica ends with its own weights",
      example={"elastic": _ELASTIC, "average_at_end": True})
def _elastic_no_average(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.average_at_end is not True:
        return None
    return ("average_at_end=True with elastic replicas: each elastic replica is a run of its own, with no collective "
            "over the others to average with at the end. Leave average_at_end=None: each replica ends with its own "
            "weights, as its checkpoint holds them (DiLoCo's final round leaves the live replicas identical).")


# -- a Fabric loop


@rule("fabric-not-paced", "build", ("pacing", "Fabric"), "`pacing` under Fabric",
      "the Trainer's strategies (`Trainer(strategy=...)`), or `pacing=None`",
      example={"strategy": "fabric:noloco", "pacing": 1.0})
def _fabric_not_paced(f: Facts) -> Optional[str]:
    if f.loop != "fabric" or f.options.pacing is None:
        return None
    return (f"pacing ({f.options.pacing_text}) under Fabric: a paced replica takes its own number of steps per round "
            "and the run ends on a round, which only the Trainer's loop lets the strategy decide. Use the Trainer's "
            "strategy of the same name, or pacing=None with Fabric.")


@rule("fabric-not-elastic", "build", ("elastic", "Fabric"), "`elastic` under Fabric",
      "the Trainer's strategies (`Trainer(strategy=...)`)",
      example={"strategy": "fabric:noloco", "elastic": _ELASTIC})
def _fabric_not_elastic(f: Facts) -> Optional[str]:
    if f.loop != "fabric" or f.options.elastic is None:
        return None
    return ("elastic replicas under Fabric: a replica that heals takes its donor's loop counters and data position, "
            "which only the Trainer's loop exposes. Use the Trainer's strategy of the same name for elastic replicas.")


# -- the outer step's own arguments


@rule("diloco-sgd-or-outer-optimizer", "build", ("outer_lr", "outer_momentum", "nesterov", "outer_optimizer"),
      "DiLoCo's outer SGD arguments changed beside an `outer_optimizer`", "one of them",
      example={"strategy": "diloco", "outer_momentum": 0.5, "outer_optimizer": _ADAM})
def _diloco_sgd(f: Facts) -> Optional[str]:
    a = f.options.algorithm
    if not isinstance(a, DiLoCo) or not a.custom_outer_optimizer:
        return None
    changed = [f"{n}={v!r}" for n, v, d in (("outer_lr", a.outer_lr, 0.7), ("outer_momentum", a.outer_momentum, 0.9),
                                            ("nesterov", a.nesterov, True)) if v != d]
    if not changed:
        return None
    one = len(changed) == 1
    return (f"{', '.join(changed)} {'configures' if one else 'configure'} DiLoCo's default outer SGD, which "
            f"outer_optimizer replaces. Put {'it' if one else 'them'} in the outer optimizer (e.g. "
            "functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)), or drop outer_optimizer.")


@rule("gasloc-momentum-or-outer-optimizer", "build", ("outer_momentum", "outer_optimizer"),
      "GASLoC's `outer_momentum` changed beside an `outer_optimizer`", "one of them",
      example={"strategy": "gasloc", "outer_momentum": 0.8, "outer_optimizer": _ADAM})
def _gasloc_momentum(f: Facts) -> Optional[str]:
    a = f.options.algorithm
    if not isinstance(a, GASLoC) or not a.custom_outer_optimizer or a.outer_momentum == 0.5:
        return None
    return (f"outer_momentum={a.outer_momentum!r} configures GASLoC's default outer SGD (lr 1, Nesterov momentum γ), "
            "which outer_optimizer replaces. Give the outer optimizer its own momentum, or drop outer_optimizer.")


@rule("gasloc-sent-default-optimizer", "build", ("momentum_on", "outer_optimizer"),
      "GASLoC's `momentum_on='sent'` with an `outer_optimizer`", "`momentum_on='mixed'` with it",
      example={"strategy": "gasloc", "momentum_on": "sent", "outer_optimizer": _ADAM})
def _gasloc_sent(f: Facts) -> Optional[str]:
    a = f.options.algorithm
    if not isinstance(a, GASLoC) or not a.sent or not a.custom_outer_optimizer:
        return None
    return ("outer_optimizer with momentum_on='sent': that form puts the momentum γ·(z − z_prev) on the sent "
            "iterates, outside any optimizer, and the summary it follows defines no place for another outer "
            "optimizer. Use momentum_on='mixed' (the default) with outer_optimizer, or drop outer_optimizer.")


@rule("gasloc-gossip-step-matchings", "build", ("gossip_step", "topology"),
      "GASLoC's `gossip_step` changed on the complete topology", "a matching topology, or the default α",
      example={"strategy": "gasloc", "topology": "complete", "gossip_step": 0.5})
def _gasloc_gossip_step(f: Facts) -> Optional[str]:
    a = f.options.algorithm
    if not isinstance(a, GASLoC) or a.topology != "complete" or a.gossip_step == 0.25:
        return None
    return (f"gossip_step={a.gossip_step!r} sets how far a replica moves towards its peer in a matching, and "
            "topology='complete' averages everyone exactly (x = mean z). Use a matching topology with it, or leave "
            "gossip_step at its default.")


@rule("gasloc-seed-random-pairs", "build", ("seed", "topology"),
      "GASLoC's `seed` changed with a topology that draws nothing", "`topology='random_pairs'` with it",
      example={"strategy": "gasloc", "topology": "ring", "seed": 3})
def _gasloc_seed(f: Facts) -> Optional[str]:
    a = f.options.algorithm
    if not isinstance(a, GASLoC) or a.seeded_schedule or a.seed == 0:
        return None
    return (f"seed={a.seed} draws GASLoC's random matchings, and topology={a.topology!r} is the same every run. Use "
            "topology='random_pairs' with it, or leave seed at 0.")


# -- the launch: processes known, none started


@rule("sync-batchnorm", "launch", ("Trainer.sync_batchnorm",), "`Trainer(sync_batchnorm=True)`",
      "each replica keeps its own statistics", example={"launch": {"nodes": 1, "devices": 2, "sync_batchnorm": True}})
def _sync_batchnorm(f: Facts) -> Optional[str]:
    if f.launch is None or not f.launch.sync_batchnorm:
        return None
    return ("sync_batchnorm=True all-reduces batch statistics in every forward pass, which defeats low-communication "
            "training. Remove sync_batchnorm=True (each replica keeps its own statistics).")


@rule("elastic-one-replica-per-trainer", "launch", ("elastic", "ranks_per_replica", "Trainer.devices"),
      "`elastic` with processes ≠ `ranks_per_replica`", "one Trainer per replica: devices × nodes = k",
      example={"elastic": _ELASTIC, "launch": {"nodes": 1, "devices": 2}})
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
      "`ranks_per_replica` not dividing the processes", "a divisor, e.g. the devices per node",
      example={"ranks_per_replica": 3, "launch": {"nodes": 1, "devices": 4}})
def _ranks_divide(f: Facts) -> Optional[str]:
    o, launch = f.options, f.launch
    if launch is None or o.elastic is not None or launch.processes % o.ranks_per_replica == 0:
        return None
    return (f"ranks_per_replica={o.ranks_per_replica} does not divide the {launch.processes} processes "
            f"({launch.nodes} node(s) × {launch.devices} device(s)). Use a divisor of {launch.processes}, e.g. the "
            f"devices per node ({launch.devices}) for one replica per node.")


@rule("replica-count", "launch", ("algorithm", "Trainer.devices"),
      "a number of replicas the schedule cannot serve (`topology='exponential'`: not a power of two)",
      "2, 4, 8, ... replicas, or another topology",
      example={"strategy": "gasloc", "topology": "exponential", "launch": {"nodes": 1, "devices": 3}})
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


_PACED = {"pacing": 1.0}
_PACED_FIT = {"parameters": (3,), "max_steps": 8}
for _name, _options, _refuses, _instead, _example, _problem in (
    ("paced-one-optimizer", ("pacing",), "`pacing` with several optimizers", "one optimizer",
     {**_PACED, "fit": {**_PACED_FIT, "parameters": (3, 2)}},
     lambda o, fit: None if len(fit.parameters) == 1 else
     f"it paces the rounds of one optimizer; this model has {len(fit.parameters)}"),
    ("paced-max-steps", ("pacing", "Trainer.max_steps"), "`pacing` without `max_steps`", "`Trainer(max_steps=...)`",
     {**_PACED, "fit": {**_PACED_FIT, "max_steps": -1}},
     lambda o, fit: None if fit.max_steps >= 1 else
     "the run is ⌈max_steps / sync_every⌉ rounds: set Trainer(max_steps=...)"),
    ("paced-no-max-epochs", ("pacing", "Trainer.max_epochs"), "`pacing` with `max_epochs`", "`max_steps` alone",
     {**_PACED, "fit": {**_PACED_FIT, "max_epochs": 3}},
     lambda o, fit: None if fit.max_epochs in (None, -1) else
     f"replicas go through their data at different speeds: leave max_epochs unset (got {fit.max_epochs}) and end "
     "the run with max_steps"),
    ("paced-no-step-checkpoints", ("pacing", "Trainer.callbacks"), "`pacing` with a `ModelCheckpoint`",
     "`lightning_loco.OuterStepCheckpoint`",
     {**_PACED, "fit": {**_PACED_FIT, "step_checkpoints": ("ModelCheckpoint",)}},
     lambda o, fit: None if not fit.step_checkpoints else
     f"{', '.join(fit.step_checkpoints)} saves by each replica's own step or epoch count: use "
     "lightning_loco.OuterStepCheckpoint (every k outer steps) or enable_checkpointing=False"),
    ("paced-no-validation", ("pacing", "Trainer.limit_val_batches"), "`pacing` with validation during fit",
     "`limit_val_batches=0`, and validate after fit", {**_PACED, "fit": {**_PACED_FIT, "validates": True}},
     lambda o, fit: None if not fit.validates else
     "validation during fit runs at each replica's own step or epoch count: set limit_val_batches=0 and validate "
     "after fit (trainer.validate) or from the checkpoints"),
):
    rule(_name, "fit", _options, _refuses, _instead, _example)(_paced(_problem))


@rule("elastic-one-optimizer", "fit", ("elastic",), "`elastic` with several optimizers", "one optimizer",
      example={"elastic": _ELASTIC, "fit": {"parameters": (3, 2)}})
def _elastic_one_optimizer(f: Facts) -> Optional[str]:
    if f.fit is None or f.options.elastic is None or len(f.fit.parameters) == 1:
        return None
    return (f"Elastic replicas support one optimizer for now; this model has {len(f.fit.parameters)}. Return one "
            "optimizer from configure_optimizers, or use elastic=None.")


@rule("fragments-enough-parameters", "fit", ("fragments",), "fewer parameters per optimizer than `fragments`",
      "`fragments` ≤ the parameters (a parameter is never split)",
      example={"sync_every": 4, "fragments": 4, "fit": {"parameters": (3,)}})
def _fragments_enough(f: Facts) -> Optional[str]:
    o = f.options
    if f.fit is None or o.fragments == 1:
        return None
    fewest = min(f.fit.parameters, default=o.fragments)
    return None if fewest >= o.fragments else too_few_parameters(o.fragments, fewest)


@rule("outer-state-device", "fit", ("outer_state_device",),
      "`outer_state_device` on another accelerator than the model",
      "None (the model's device) or 'cpu'", example={"outer_state_device": "cuda", "fit": {"parameters": (3,)}})
def _outer_state_device(f: Facts) -> Optional[str]:
    device = f.options.outer_state_device
    if f.fit is None or device is None or device.type in ("cpu", f.fit.model_device):
        return None
    return (f"outer_state_device={str(device)!r} does not match the model's device type {f.fit.model_device!r}. Use "
            "None or 'cpu'.")


@rule("disjoint-optimizers", "fit", ("configure_optimizers",), "a parameter in two optimizers",
      "disjoint parameter sets (each optimizer has its own outer state)",
      example={"fit": {"parameters": (3, 3), "shared_parameter": ((4,), 0, 1)}})
def _disjoint_optimizers(f: Facts) -> Optional[str]:
    if f.fit is None or f.fit.shared_parameter is None:
        return None
    shape, a, b = f.fit.shared_parameter
    return (f"A parameter of shape {shape} belongs to optimizers {a} and {b}. Each parameter must belong to one "
            "optimizer: every optimizer has its own outer state. Give each optimizer a disjoint set of parameters.")


# ---------------------------------------------------------------- the docs


def rules_table() -> str:
    """:data:`RULES` as the Markdown table of docs/options.md."""
    lines = ["| checked | rule | options | refused | instead |", "|---|---|---|---|---|"]
    for r in RULES:
        options = ", ".join(f"`{o}`" for o in r.options)
        lines.append(f"| {r.when} | `{r.name}` | {options} | {r.refuses} | {r.instead} |")
    return "\n".join(lines)
