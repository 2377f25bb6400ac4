"""Which data an elastic replica reads (lightning_loco.elastic.data): its part with data slots, its own order
without; the config's checks. The CLI recipe's run of three replicas is in test_elastic.py."""

import pytest
from torch.utils.data import DistributedSampler

from lightning_loco import ElasticConfig
from lightning_loco.algorithms import NoLoCo
from lightning_loco.elastic.data import order_seed, sampler_kwargs, shared_slots, slot_of
from lightning_loco.replica.modes import RunMode
from lightning_loco.rules import build_options

torchft = pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")


def order(kwargs, n=48, epoch=0):
    sampler = DistributedSampler(range(n), shuffle=True, **kwargs)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_slots_cut_the_data_as_a_static_launch_does():
    """Slot s of N, rank j of k: part s·k + j of N·k, under the run's seed, so the parts are a static launch's."""
    for k in (1, 2):
        parts = [order(sampler_kwargs(f"site-{s}", 3, None, k, j, seed=7)) for s in range(3) for j in range(k)]
        static = [order({"num_replicas": 3 * k, "rank": r, "seed": 7}) for r in range(3 * k)]
        assert parts == static
        assert sorted(i for part in parts for i in part) == list(range(48))
    assert sampler_kwargs("anything", 4, 2, 1, 0, seed=0)["rank"] == 2  # a given slot wins over the id


def test_without_slots_each_replica_reads_everything_in_its_own_order():
    a, b = (order(sampler_kwargs(name, None, None, 1, 0, seed=0)) for name in ("site-a", "site-b"))
    assert sorted(a) == sorted(b) == list(range(48)) and a != b
    assert order(sampler_kwargs("site-a", None, None, 1, 0, seed=0)) == a  # a restart under the same id continues
    assert order_seed(1, "site-a") != order_seed(0, "site-a")  # the run's seed still counts
    # two ranks of one replica cut its order between them
    ranks = [order(sampler_kwargs("site-a", None, None, 2, j, seed=0)) for j in range(2)]
    assert sorted(ranks[0] + ranks[1]) == list(range(48))


def test_the_static_launch_keeps_lightnings_sampler():
    default = {"num_replicas": 4, "rank": 3}
    assert RunMode().sampler_kwargs(default, 1, 2, seed=0) is default


def test_replica_ids_name_their_slot_and_clashes_are_found():
    assert [slot_of(x) for x in ("site-0", "gpu12", "a", "x-3-b")] == [0, 12, None, None]
    assert shared_slots(["site-1", "east-1", "site-2"], 3, None, "site-2") == [("east-1", "site-1", 1)]
    assert shared_slots(["site-1", "site-2"], 3, 2, "site-1") == [("site-1", "site-2", 2)]  # my given slot
    assert shared_slots(["site-1", "east-1"], None, None, "site-1") == []  # no slots: each its own order
    assert shared_slots(["site-1", "east-1"], 1, None, "site-1") == []  # one slot: the same data, as asked


@pytest.mark.parametrize("fields, message", [
    ({"data_slots": 3, "replica_id": "site-5"}, "replica_id='site-5' ends with 5, so it names no part of the data 0 "
                                                "to 2. Name the replicas by their slot"),
    ({"data_slots": 3, "replica_id": "east"}, "ends with no number"),
    ({"data_slot": 1, "replica_id": "a"}, "data_slot=1 needs data_slots"),
    ({"data_slots": 3, "data_slot": 3, "replica_id": "a"}, r"data_slot=3 must be below data_slots=3"),
    ({"data_slots": 0, "replica_id": "a"}, "data_slots must be an integer >= 1"),
    ({"data_slots": 2.5, "replica_id": "a"}, "data_slots must be an integer >= 1"),
])
def test_data_fields_are_checked_with_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):  # a field's own value, or a rule of the fields together
        build_options(NoLoCo(), 10, elastic=ElasticConfig(lighthouse="127.0.0.1:29510", **fields))


def test_a_named_slot_or_an_explicit_one_is_accepted():
    for fields in ({"replica_id": "site-2", "data_slots": 3}, {"replica_id": "east", "data_slots": 3, "data_slot": 0},
                   {"replica_id": "east", "data_slots": 1}):
        config = ElasticConfig(lighthouse="127.0.0.1:29510", **fields)
        config.check()
        build_options(NoLoCo(), 10, elastic=config)


def test_the_strategy_hands_lightning_the_replicas_part():
    from lightning_loco import NoLoCoStrategy

    strategy = NoLoCoStrategy(elastic=ElasticConfig(lighthouse="127.0.0.1:29510", replica_id="site-1", data_slots=2))
    kwargs = strategy.distributed_sampler_kwargs
    assert kwargs == {"num_replicas": 2, "rank": 1, "seed": 0}
    assert order(kwargs) == order({"num_replicas": 2, "rank": 1, "seed": 0})


def test_an_elastic_replica_has_no_consensus_state_dict():
    from lightning_loco import NoLoCoStrategy

    strategy = NoLoCoStrategy(elastic=ElasticConfig(lighthouse="127.0.0.1:29510", replica_id="site-1"))
    with pytest.raises(RuntimeError, match="elastic replicas have no collective over each other; save this"):
        strategy.consensus_state_dict()


def test_batchnorm_update_is_refused_for_elastic_replicas():
    from types import SimpleNamespace

    from lightning_loco import BatchNormUpdate, NoLoCoStrategy

    strategy = NoLoCoStrategy(elastic=ElasticConfig(lighthouse="127.0.0.1:29510", replica_id="site-1"))
    with pytest.raises(ValueError, match="BatchNormUpdate re-estimates the statistics of the replicas' consensus"):
        BatchNormUpdate().setup(SimpleNamespace(strategy=strategy), None, "fit")
    BatchNormUpdate().setup(SimpleNamespace(strategy=NoLoCoStrategy()), None, "fit")  # a static launch: fine
