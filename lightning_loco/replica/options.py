"""The options of a run, grouped as a user sets them: data that every layer may read (the strategies, the
driver, the simulator). Which combinations run is :mod:`lightning_loco.rules`'s table.

A strategy takes a handful of flat arguments that everyone tunes (``sync_every``, the outer step's
learning rate and momentum, ``overlap_steps``, ``fragments``, ``ranks_per_replica``) and one object
per mode that has a vocabulary of its own:

* ``wire=``: how payloads travel, a format name (``"bfloat16"``, ``"int8"``, ...) or a
  :class:`WireConfig` (int8's block size, error feedback);
* ``pacing=``: replicas of different speeds, a number of seconds or a :class:`PacingConfig`;
* ``replica_sharding=``: FSDP2 inside a replica, ``"fsdp"`` or an :class:`FSDPConfig`;
* ``elastic=``: replicas that come and go, an :class:`~lightning_loco.elastic.config.ElasticConfig`.

:class:`Options` holds all of them for one run (the Lightning strategies, the Fabric strategies and the
simulator build one, and the driver reads it). Each option checks its own value when it is built; every
combination that cannot run is refused by one rule of :data:`lightning_loco.rules.RULES`, which
the strategies and the simulator check (:func:`lightning_loco.rules.build_options`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import torch

from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.driver.overlap import MERGES as OVERLAP_MERGES
from lightning_loco.driver.overlap import OverlapSteps, check_overlap_steps
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.wire.codecs import DEFAULT_BLOCK_SIZE, FORMATS, WireFormat, make_codec
from lightning_loco.wire.sparse import (
    DEFAULT_DECAY,
    DEFAULT_DENSITY,
    DEFAULT_MEAN,
    DEFAULT_VALUE_FORMAT,
    MEANS,
    VALUE_FORMATS,
)

WireFormatName = Literal["float32", "bfloat16", "float16", "int8", "int4", "int2", "topk"]
ValueFormatName = Literal["int8", "int4", "int2", "float16"]
TopKMeanName = Literal["replicas", "senders"]
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
            ``block_size`` values as int8 with one float32 scale: about a quarter of the bytes), "int4" or
            "int2" (the same with 4-bit or 2-bit values: about an eighth or a sixteenth), or "topk" (the
            ``density`` largest values of each chunk of 4096, with their positions, in ``value_format``;
            pseudo-gradient payloads (DiLoCo) with error feedback only).
        block_size: int8, int4 and int2 only: values per scale, an integer >= 1 (None: 256, where 1.6 % of
            the int8 bytes are scales; smaller blocks follow outliers more closely).
        density: topk only: the share of each chunk's values sent, a number in (0, 1] (None: 0.02).
        value_format: topk only: the format of the values sent, "int8", "int4", "int2" or "float16", with
            one float32 scale per chunk for the integer formats (None: "int2").
        topk_mean: topk only: how the replicas' sparse payloads are averaged: "senders" (SparseLoCo's: each
            position's mean over the replicas that sent it; None means this) or "replicas" (each payload's values
            count 1/N, as if the others sent zero where it sent a value). "senders" needs DiLoCo without outer
            momentum (``outer_momentum=0``, with ``outer_lr=1`` as SparseLoCo): docs/compression.md.
        error_feedback: lossy formats only: keep what the codec lost of each payload and add it to the
            next (saved in checkpoints). None (default): on where the payload is a pseudo-gradient
            (DiLoCo), off where it is weights (NoLoCo, GASLoC), as docs/compression.md measured.
        error_feedback_decay: with error feedback only: β in (0, 1], the weight of the residual added to the next
            payload (None: 0.95 with topk, SparseLoCo's accumulator; 1, plain error feedback, with the other
            formats): docs/compression.md.
        streams: connections per pair of replicas: "auto" (default) or an integer >= 1. s > 1 cuts every
            exchange and all-reduce into s pieces, each over a process group of its own (gloo opens a connection
            per group), for a long fat pipe, where one TCP connection carries at most its send buffer per round
            trip (docs/launching.md). "auto" cuts each message into one piece per 4 MB, at most 8, over as many
            groups as the model's payload needs (none under 8 MB); it is one stream on NCCL, with replicas of
            several ranks, with ``elastic`` and with a ``transport_factory``, where streams cannot work (see
            ``lightning_loco.transport.streams``). A pair exchange's sums, and the all-reduce's of three replicas
            or more above 64 KiB (ours), are bitwise those of one stream; gloo's own all-reduce (smaller payloads)
            may differ in the last bit with 3 or more replicas and s > 1 (gloo picks each piece's order of
            additions). An integer s > 1: replicas of one rank, on the strategies' own transport (not with
            ``elastic`` or a ``transport_factory``).
    """

    format: WireFormatName = "float32"
    block_size: Optional[int] = None
    error_feedback: Optional[bool] = None
    streams: Union[int, Literal["auto"]] = "auto"
    density: Optional[float] = None
    value_format: Optional[ValueFormatName] = None
    error_feedback_decay: Optional[float] = None
    topk_mean: Optional[TopKMeanName] = None

    def check(self) -> None:
        """Raises ``ValueError`` naming a field that holds no value it can take (checked with the options)."""
        if self.format not in FORMATS:
            raise ValueError(
                f"wire format must be one of {', '.join(map(repr, FORMATS))}, got {self.format!r}. 'float32' (the "
                "default) sends payloads as they are; 'bfloat16' and 'float16' halve the bytes; 'int8' quarters them; "
                "'int4' and 'int2' send 4 and 2 bits per value; 'topk' sends a few values of each chunk (DiLoCo)."
            )
        if self.block_size is not None:
            check_int("wire block_size", self.block_size,
                      f"The default, {DEFAULT_BLOCK_SIZE}, spends 4 bytes of scale per {DEFAULT_BLOCK_SIZE} values "
                      "(1.6 % on top of int8); smaller blocks follow outliers more closely for more scale bytes.")
        if self.error_feedback is not None:
            _check_bool("wire error_feedback", self.error_feedback,
                        "None (the default) turns it on for pseudo-gradient payloads (DiLoCo) with a lossy format.")
        if self.density is not None:
            value = self.density
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"wire density must be a number in (0, 1], got {value!r}: the share of each chunk's "
                                 f"values topk sends, e.g. 0.01 to 0.03 (None: {DEFAULT_DENSITY}).")
        if self.error_feedback_decay is not None:
            value = self.error_feedback_decay
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"wire error_feedback_decay must be a number in (0, 1], got {value!r}: the weight of "
                                 "the residual added to the next payload (None: 1, plain error feedback; SparseLoCo "
                                 "uses 0.95).")
        if self.value_format is not None and self.value_format not in VALUE_FORMATS:
            raise ValueError(f"wire value_format must be one of {', '.join(map(repr, VALUE_FORMATS))}, got "
                             f"{self.value_format!r}: the format of the values topk sends (None: "
                             f"{DEFAULT_VALUE_FORMAT!r}, 2 bits per value with one scale per chunk).")
        if self.topk_mean is not None and self.topk_mean not in MEANS:
            raise ValueError(f"wire topk_mean must be one of {', '.join(map(repr, MEANS))}, got {self.topk_mean!r}: "
                             "how topk's sparse payloads are averaged ('senders': each position over the replicas that "
                             f"sent it, SparseLoCo's; 'replicas': every payload counts 1/N; None: {DEFAULT_MEAN!r}).")
        if self.streams != "auto":
            check_int("wire streams", self.streams,
                      "'auto' (the default) chooses from the payload's size; 1 sends each exchange over one connection "
                      "per pair; s > 1 over s of them.")

    @property
    def lossy(self) -> bool:
        return self.format != "float32"

    def resolve(self, pseudo_gradient: bool) -> WireFormat:
        """The codec and the error feedback of a run whose payloads are pseudo-gradients (or weights)."""
        codec = make_codec(self.format, self.block_size or DEFAULT_BLOCK_SIZE,
                           DEFAULT_DENSITY if self.density is None else self.density,
                           self.value_format or DEFAULT_VALUE_FORMAT, self.topk_mean or DEFAULT_MEAN)
        feedback = pseudo_gradient if self.error_feedback is None else self.error_feedback
        decay = float(self.error_feedback_decay) if self.error_feedback_decay is not None else (
            DEFAULT_DECAY if self.format == "topk" else 1.0)
        return WireFormat(codec, feedback and codec.lossy, decay)


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
    """Every option of one run, each checked when built (``ValueError`` naming what to do instead). The
    strategies' arguments of the same names; ``algorithm`` is the outer step they build. Whether they go
    together is for the rules (:func:`lightning_loco.rules.build_options`)."""

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


GROUPS: dict[str, type] = {"wire": WireConfig, "pacing": PacingConfig, "replica_sharding": FSDPConfig,
                           "elastic": ElasticConfig}  # the options that are objects of their own
