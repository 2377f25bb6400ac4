"""Streaming fragments through the Lightning strategies: the argument on all three and on the command
line, what is refused, exact resume with a fragment's round in flight, every fragment landing at the
end of ``fit``, and replicas of two ranks.

The runs are real multi-process Trainers of ``tests/tiny.py`` (four parameters: with F = 2 the body's
weight is one fragment and the three small tensors the other). H = 4, F = 2: fragment 1's rounds start
after steps 2, 6, 10, fragment 0's after 4, 8, 12; with τ = 1 each lands one step later.
"""

import glob
import os
import sys

import pytest
import torch

from lightning_loco import DiLoCoStrategy, ElasticConfig, GASLoCStrategy, NoLoCoStrategy
from lightning_loco.cli import main

import tiny
from test_checkpoints import assert_same_tree
from test_cli import CONFIGS

H, K, F = 4, 6, 2
STRATEGIES = [NoLoCoStrategy, GASLoCStrategy, DiLoCoStrategy]


@pytest.mark.parametrize("cls", STRATEGIES)
def test_every_strategy_takes_fragments(cls):
    strategy = cls(sync_every=8, fragments=4, overlap_steps=1)
    assert strategy.fragments == 4
    assert cls(sync_every=8).fragments == 1


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"fragments": 3}, r"fragments=3 must divide sync_every=8.*Use one of \[1, 2, 4, 8\]"),
        ({"fragments": 4, "overlap_steps": 2}, "overlap_steps=2 must be smaller than sync_every / fragments = 2"),
        ({"fragments": 2, "pacing": 1.0}, "fragments=2 does not work with pacing"),
        ({"fragments": 2, "replica_sharding": "fsdp"}, "fragments=2 does not work with replica_sharding"),
        ({"fragments": 2, "elastic": ElasticConfig("http://localhost:1")},
         "fragments=2 does not work with elastic replicas"),
        ({"fragments": 0}, "fragments must be an integer >= 1, got 0"),
    ],
)
def test_combinations_that_do_not_compose_are_refused_when_the_strategy_is_built(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(sync_every=8, **kwargs)


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setattr(sys, "argv", ["lightning-loco"])


def test_the_command_line_takes_fragments(in_process, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(CONFIGS / "noloco.yaml"), "--trainer.strategy.init_args.fragments=5",
              "--print_config"])
    assert exit_.value.code == 0
    assert "fragments: 5" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(CONFIGS / "noloco.yaml"), "--trainer.strategy.init_args.fragments=3"])
    assert exit_.value.code == 2
    assert "fragments=3 must divide sync_every=50" in capsys.readouterr().err


@pytest.mark.parametrize("algorithm,kwargs", [
    ("noloco", {}),
    ("gasloc", {}),
    ("diloco", {"wire": {"format": "int8", "block_size": 4}}),  # error feedback per fragment
])
def test_exact_resume_with_a_fragments_round_in_flight_and_every_fragment_lands_at_the_end(tmp_path, algorithm,
                                                                                          kwargs):
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": K, "save_top_k": -1}
    kwargs = {"sync_every": H, "fragments": F, "overlap_steps": 1, **kwargs}
    common = {"strategy": algorithm, "strategy_kwargs": kwargs, "devices": 2, "max_steps": 2 * K}
    straight = tiny.launch(tmp_path / "straight", checkpoint=checkpoint, **common)
    (sidecar,) = glob.glob(str(ckpts / ".replicas" / f"step={K}.ckpt-*"))
    saved = torch.load(os.path.join(sidecar, "replica-00000.pt"), weights_only=True)["outer"]
    assert [entry["in_flight"] is not None for entry in saved] == [False, True]  # fragment 1's round of step 6
    assert (saved[1]["in_flight"]["outer_step"], saved[1]["in_flight"]["start_step"]) == (1, K)
    if algorithm == "diloco":
        assert all(entry["residual"].numel() == entry["numel"] for entry in saved)  # a residual per fragment
    resumed = tiny.launch(tmp_path / "resumed", ckpt_path=str(ckpts / f"step={K}.ckpt"), **common)
    for r in range(2):
        for step, (a, b) in enumerate(zip(straight[r]["weights"][K:], resumed[r]["weights"])):
            assert torch.equal(a, b), (r, K + step)
        assert_same_tree(straight[r]["outer_states"], resumed[r]["outer_states"], "outer")
        assert_same_tree(straight[r]["optimizer_states"], resumed[r]["optimizer_states"], "optimizer")
        assert [s["numel"] for s in straight[r]["outer_states"]] == [12, 7]  # body.weight | the rest
        # the end of fit: the last step starts a round of each fragment, and both land as final rounds
        reports = torch.load(tmp_path / "straight" / "out" / f"after_fit{r}.pt")["reports"]
        assert [(x["fragment"], x["inner_step"]) for x in reports] == [
            (1, 3), (0, 5), (1, 7), (0, 9), (1, 11), (0, 12), (1, 12)]
        assert [x["final"] for x in reports] == [False] * 5 + [True, True]


def test_fragments_between_replicas_of_two_ranks(tmp_path):
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": H, "fragments": F,
                                                                     "ranks_per_replica": 2},
                       devices=4, max_steps=2 * H)
    for r, rec in enumerate(recs):
        # the two ranks of a replica hold bitwise the same weights after every step
        assert all(torch.equal(w, v) for w, v in zip(rec["weights"], recs[r - r % 2]["weights"]))
        numels = [s["numel"] for s in rec["outer_states"]]
        assert numels == [12, 7]
        # each round moves this rank's slice of its fragment: 1/2 of the fragment per rank
        mine = [torch.tensor_split(torch.empty(n), 2)[r % 2].numel() * 4 for n in numels]
        assert [(x["fragment"], x["bytes_sent"]) for x in rec["reports"]] == [
            (1, mine[1]), (0, mine[0]), (1, mine[1]), (0, mine[0]), (1, mine[1])]  # step 8: a round of each
    # apart after step 6 (fragment 0 last met at step 4); the pair's mean on every fragment after the last
    assert not torch.equal(recs[0]["weights"][5], recs[2]["weights"][5])
    assert torch.equal(recs[0]["weights"][-1], recs[2]["weights"][-1])


def test_each_fragment_meets_its_own_peers_over_gloo(tmp_path):
    """Four replicas, NoLoCo in pairs, two fragments with τ = 1: every round's pairs are mutual across
    the replicas, each fragment follows its own schedule, and the fragments' pairs differ somewhere."""
    from lightning_loco.algorithms import NoLoCo
    from lightning_loco.driver.fragments import fragment_algorithm

    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": H, "fragments": F,
                                                                     "overlap_steps": 1, "seed": 3},
                       devices=4, max_steps=4 * H)
    met = {}
    for r, rec in enumerate(recs):
        for x in rec["reports"]:
            met[(x["fragment"], x["outer_step"], r)] = tuple(x["peers"])
    schedules = [fragment_algorithm(NoLoCo(seed=3), f) for f in range(F)]
    for (f, t, r), peers in met.items():
        assert peers == schedules[f].schedule(t, 4).peers_of(r)
        assert all(met[(f, t, j)] == tuple(sorted({r} | set(peers) - {j})) for j in peers)  # mutual
    assert any(met[(0, t, 0)] != met[(1, t, 0)] for t in range(3))
