"""The rules about modes, checked when the strategy is built: elastic replicas, the wire's streams, a Fabric
loop, and each outer step's own arguments (the second part of the table of :mod:`lightning_loco.rules`)."""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

from lightning_loco.algorithms import diloco, gasloc
from lightning_loco.algorithms.base import OuterAlgorithm
from lightning_loco.algorithms.diloco import DiLoCo
from lightning_loco.algorithms.gasloc import GASLoC
from lightning_loco.elastic.data import slot_of
from lightning_loco.rules.table import Facts, Rules

A = TypeVar("A", bound=OuterAlgorithm)


RULES = Rules()
rule = RULES.rule


# -- elastic replicas


@rule("elastic-not-overlapped", "build", ("elastic", "overlap_steps"),
      "`elastic` with `overlap_steps` ≠ 0", "`overlap_steps=0`")
def _elastic_not_overlapped(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.overlap_steps == 0:
        return None
    return (f"overlap_steps={o.overlap_steps!r} with elastic replicas: elastic mode switches memberships and heals "
            "joiners between rounds, where an overlapped round would still be in flight (with partners that may have "
            "left, and a state no joiner can take half-sent). Use overlap_steps=0 (the default).")


@rule("elastic-collective-lossy-ranks", "build", ("elastic", "ranks_per_replica", "wire", "algorithm"),
      "`elastic` with `ranks_per_replica` > 1, a lossy wire and a collective algorithm (DiLoCo)",
      "the float32 wire, or one rank per replica")
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
      "`topology='random_pairs'` or `'ring'`")
def _elastic_any_replica_count(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.algorithm.any_replica_count:
        return None
    return ("topology='exponential' with elastic replicas: it needs a power-of-two number of replicas, and the number "
            "of live replicas changes. Use topology='random_pairs' (the default) or 'ring'.")


@rule("elastic-not-paced", "build", ("elastic", "pacing"), "`elastic` with `pacing`", "one of them")
def _elastic_not_paced(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.pacing is None:
        return None
    return (f"pacing ({o.pacing_text}) and elastic replicas cannot be combined yet: a replica "
            "that heals takes a donor's step counts. Use pacing=None with elastic replicas, or the static launch.")


@rule("elastic-own-transport", "build", ("elastic", "transport_factory"), "`elastic` with `transport_factory`",
      "one of them")
def _elastic_own_transport(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.transport_factory is None:
        return None
    return ("transport_factory and elastic replicas are exclusive: elastic replicas bring their own transport (over "
            "the live members). Pass one of them.")


@rule("streams-one-rank-per-replica", "build", ("wire.streams", "ranks_per_replica"),
      "`wire.streams` > 1 with `ranks_per_replica` > 1",
      "`wire.streams=\"auto\"` (one stream there) or `1` with replicas of several ranks")
def _streams_one_rank(f: Facts) -> Optional[str]:
    o = f.options
    if o.wire.streams in (1, "auto") or o.ranks_per_replica == 1:
        return None
    return (f"wire.streams={o.wire.streams} with ranks_per_replica={o.ranks_per_replica}: a replica of several ranks "
            "already spreads its exchange over its ranks' own connections (rank j sends slice j), and the streams "
            "would multiply every rank's groups. Use wire.streams=\"auto\" (the default: one stream there) or 1 with "
            "replicas of several ranks.")


@rule("streams-own-transport", "build", ("wire.streams", "elastic", "transport_factory"),
      "`wire.streams` > 1 with `elastic` or a `transport_factory`",
      "`wire.streams=\"auto\"` (one stream there) or `1` (give the streams to your own transport)")
def _streams_own_transport(f: Facts) -> Optional[str]:
    o = f.options
    if o.wire.streams in (1, "auto") or (o.elastic is None and o.transport_factory is None):
        return None
    whose = "elastic replicas' transport (over the live members)" if o.elastic is not None else "a transport_factory"
    return (f"wire.streams={o.wire.streams} is an option of the strategies' own torch.distributed transport, not of "
            f"{whose}. Use wire.streams=\"auto\" (the default: one stream there) or 1 (a factory of your own can "
            "take streams itself, e.g. functools.partial(TorchDistributedTransport, streams=4)).")


@rule("elastic-no-average-at-end", "build", ("elastic", "average_at_end"), "`elastic` with `average_at_end=True`",
      "`average_at_end=None` (or False): each replica ends with its own weights")
def _elastic_no_average(f: Facts) -> Optional[str]:
    o = f.options
    if o.elastic is None or o.average_at_end is not True:
        return None
    return ("average_at_end=True with elastic replicas: each elastic replica is a run of its own, with no collective "
            "over the others to average with at the end. Leave average_at_end=None: each replica ends with its own "
            "weights, as its checkpoint holds them (DiLoCo's final round leaves the live replicas identical).")


# -- an elastic replica's own fields, against each other


@rule("elastic-straggler-below-timeout", "build", ("elastic.straggler_timeout", "elastic.outer_step_timeout"),
      "`straggler_timeout` ≥ `outer_step_timeout`", "a lower `straggler_timeout`, or None")
def _elastic_straggler_below_timeout(f: Facts) -> Optional[str]:
    e = f.options.elastic
    if e is None or e.straggler_timeout is None or e.straggler_timeout < e.outer_step_timeout:
        return None
    return (f"straggler_timeout={e.straggler_timeout} must be below outer_step_timeout={e.outer_step_timeout}: past "
            "outer_step_timeout a partner counts as failed (its membership's group is closed). Lower "
            "straggler_timeout, or leave it None.")


@rule("elastic-data-slot-needs-slots", "build", ("elastic.data_slot", "elastic.data_slots"),
      "`data_slot` without `data_slots`", "`data_slots=N` as well, or `data_slot=None`")
def _elastic_data_slot_needs_slots(f: Facts) -> Optional[str]:
    e = f.options.elastic
    if e is None or e.data_slots is not None or e.data_slot is None:
        return None
    return (f"data_slot={e.data_slot} needs data_slots, the number of parts the data is cut into: set data_slots=N "
            "as well (every replica the same N), or leave data_slot None.")


@rule("elastic-data-slot-below-slots", "build", ("elastic.data_slot", "elastic.data_slots"),
      "`data_slot` ≥ `data_slots`", "a slot from 0 to `data_slots` − 1")
def _elastic_data_slot_below_slots(f: Facts) -> Optional[str]:
    e = f.options.elastic
    if e is None or e.data_slots is None or e.data_slot is None or e.data_slot < e.data_slots:
        return None
    slots = e.data_slots
    return f"data_slot={e.data_slot} must be below data_slots={slots} (the parts are 0 to {slots - 1})."


@rule("elastic-replica-id-names-slot", "build", ("elastic.replica_id", "elastic.data_slots", "elastic.data_slot"),
      "`data_slots` > 1 and a `replica_id` that ends with no slot's number",
      "replica ids named by their slot (`site-0`, ...), or `data_slot`")
def _elastic_replica_id_names_slot(f: Facts) -> Optional[str]:
    e = f.options.elastic
    if e is None or e.data_slots is None or e.data_slot is not None or e.data_slots <= 1:
        return None
    slots, found = e.data_slots, slot_of(e.name)
    if found is not None and found < slots:
        return None
    ends = f"ends with {found}" if found is not None else "ends with no number"
    return (f"data_slots={slots}: replica_id={e.name!r} {ends}, so it names no part of the data 0 to {slots - 1}. "
            f"Name the replicas by their slot (e.g. site-0 ... site-{slots - 1}), or give this one data_slot=.")


# -- a Fabric loop


@rule("fabric-not-paced", "build", ("pacing", "Fabric"), "`pacing` under Fabric",
      "the Trainer's strategies (`Trainer(strategy=...)`), or `pacing=None`")
def _fabric_not_paced(f: Facts) -> Optional[str]:
    if f.loop != "fabric" or f.options.pacing is None:
        return None
    return (f"pacing ({f.options.pacing_text}) under Fabric: a paced replica takes its own number of steps per round "
            "and the run ends on a round, which only the Trainer's loop lets the strategy decide. Use the Trainer's "
            "strategy of the same name, or pacing=None with Fabric.")


@rule("fabric-not-elastic", "build", ("elastic", "Fabric"), "`elastic` under Fabric",
      "the Trainer's strategies (`Trainer(strategy=...)`)")
def _fabric_not_elastic(f: Facts) -> Optional[str]:
    if f.loop != "fabric" or f.options.elastic is None:
        return None
    return ("elastic replicas under Fabric: a replica that heals takes its donor's loop counters and data position, "
            "which only the Trainer's loop exposes. Use the Trainer's strategy of the same name for elastic replicas.")


# -- the outer step's own arguments (each algorithm says what of its own arguments does not go together)


def _of(kind: type[A], problem: Callable[[A], Optional[str]]) -> Callable[[Facts], Optional[str]]:
    """A build rule about the arguments of one algorithm class: ``problem`` reads them (beside the algorithm)."""

    def check(f: Facts) -> Optional[str]:
        a = f.options.algorithm
        return problem(a) if isinstance(a, kind) else None

    return check


for _name, _options, _refuses, _instead, _check in (
    ("diloco-sgd-or-outer-optimizer", ("outer_lr", "outer_momentum", "nesterov", "outer_optimizer"),
     "DiLoCo's outer SGD arguments changed beside an `outer_optimizer`", "one of them",
     _of(DiLoCo, diloco.sgd_beside_optimizer)),
    ("gasloc-momentum-or-outer-optimizer", ("outer_momentum", "outer_optimizer"),
     "GASLoC's `outer_momentum` changed beside an `outer_optimizer`", "one of them",
     _of(GASLoC, gasloc.momentum_beside_optimizer)),
    ("gasloc-sent-default-optimizer", ("momentum_on", "outer_optimizer"),
     "GASLoC's `momentum_on='sent'` with an `outer_optimizer`", "`momentum_on='mixed'` with it",
     _of(GASLoC, gasloc.sent_with_optimizer)),
    ("gasloc-gossip-step-matchings", ("gossip_step", "topology"),
     "GASLoC's `gossip_step` changed on the complete topology", "a matching topology, or the default α",
     _of(GASLoC, gasloc.gossip_step_without_matchings)),
    ("gasloc-seed-random-pairs", ("seed", "topology"),
     "GASLoC's `seed` changed with a topology that draws nothing", "`topology='random_pairs'` with it",
     _of(GASLoC, gasloc.seed_without_draws)),
):
    rule(_name, "build", _options, _refuses, _instead)(_check)
