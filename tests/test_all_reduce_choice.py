"""all_reduce="auto": the first rounds of a payload try ours and gloo's all-reduce (cut over the stream groups, and
whole on one connection where the payload is cut) in turn, the replicas share
their fastest times ahead of the next round's payload, and every replica takes the same decision from the
times summed in replica order. The decision logic without processes; the agreement over real gloo processes,
with each replica's own times skewed so that one replica alone would decide otherwise."""

import math
import os

import pytest
import torch
import torch.distributed as dist

from lightning_loco.testing.launch import free_port, init_gloo, start_ranks
from lightning_loco.transport import TorchDistributedTransport, sum_in_group_order
from lightning_loco.transport.choice import (
    BACKEND,
    BACKEND_WHOLE,
    P2P,
    TRIALS,
    TRIALS_CUT,
    AllReduceChoice,
    check_all_reduce,
    trials_for,
)

import tiny

NUMEL = 1001
ROUNDS = len(TRIALS) + 3  # the trials, the round that carries the times, two rounds after the decision
WHOLE_ROUNDS = (2, 5, 7)  # the rounds a payload cut in two takes whole below: two trials, then decided whole


def test_a_payload_tries_each_all_reduce_twice_then_carries_its_times_then_keeps_the_decision():
    choice = AllReduceChoice()
    assert TRIALS == (P2P, BACKEND, P2P, BACKEND)
    rounds = []
    for _ in TRIALS:
        rounds.append(choice.next_round())
        assert choice.last_was_trial
    assert rounds == [(a, False) for a in TRIALS]
    for algorithm, seconds in zip(TRIALS, (3.0, 2.0, 1.5, 2.5)):
        choice.record(algorithm, seconds)
    assert torch.equal(choice.mine(), torch.tensor([1.5, 2.0, math.inf], dtype=torch.float64))  # the fastest of each
    assert choice.next_round() == (P2P, True)  # ours, carrying the times
    assert choice.next_round() == (P2P, False)  # not decided yet (the times travel): ours, nothing carried
    assert not choice.last_was_trial  # so the transport records neither round's time
    others = {j: torch.tensor([4.0, 1.0, math.inf], dtype=torch.float64) for j in (1, 2)}
    assert choice.decide({0: choice.mine(), **others}) == BACKEND  # 9.5 against 4.0, though replica 0 saw ours win
    assert choice.totals == (9.5, 4.0, math.inf)
    assert [choice.next_round() for _ in range(3)] == [(BACKEND, False)] * 3
    choice.record(P2P, 0.1)  # nor anything after the decision
    assert choice.seconds[P2P] == [3.0, 1.5]


def test_a_payload_cut_into_pieces_also_tries_gloos_all_reduce_whole_and_may_take_it():
    assert trials_for(1) == TRIALS and trials_for(2) == trials_for(8) == TRIALS_CUT
    assert TRIALS_CUT == (P2P, BACKEND, BACKEND_WHOLE, P2P, BACKEND, BACKEND_WHOLE)
    choice = AllReduceChoice(TRIALS_CUT)
    assert [choice.next_round() for _ in TRIALS_CUT] == [(a, False) for a in TRIALS_CUT]
    for algorithm, seconds in zip(TRIALS_CUT, (3.0, 2.0, 2.5, 2.9, 1.8, 2.4)):
        choice.record(algorithm, seconds)
    assert torch.equal(choice.mine(), torch.tensor([2.9, 1.8, 2.4], dtype=torch.float64))
    assert choice.next_round() == (P2P, True)
    other = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)  # one replica saw the cut ring win, one the whole
    assert choice.decide({0: choice.mine(), 1: other}) == BACKEND_WHOLE  # 5.9, 3.8, 3.4
    assert choice.next_round() == (BACKEND_WHOLE, False)


def test_a_tie_keeps_the_earlier_candidate_and_an_untimed_all_reduce_counts_as_infinitely_slow():
    tie = AllReduceChoice()
    assert tie.decide({0: torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)}) == P2P
    cut_tie = AllReduceChoice(TRIALS_CUT)
    assert cut_tie.decide({0: torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64)}) == BACKEND  # cut before whole
    untimed = AllReduceChoice()
    untimed.record(P2P, 2.0)
    mine = untimed.mine()
    assert mine[0] == 2.0 and math.isinf(mine[1]) and math.isinf(mine[2])
    assert untimed.decide({0: mine, 1: torch.tensor([math.inf, 1.0, math.inf], dtype=torch.float64)}) == P2P
    nothing = AllReduceChoice()  # every total inf (inf == inf): ours
    assert nothing.decide({0: nothing.mine()}) == P2P


def test_trials_of_an_unknown_all_reduce_are_refused():
    with pytest.raises(ValueError, match="trials must be a non-empty sequence of \\('p2p', 'backend', "
                       "'backend_whole'\\)"):
        AllReduceChoice(("p2p", "ring"))
    with pytest.raises(ValueError, match="non-empty"):
        AllReduceChoice(())


def test_ours_is_refused_where_it_cannot_run_and_an_unknown_choice_names_the_choices():
    for backend in ("gloo", "nccl"):
        for choice in ("auto", "backend", "backend_whole"):
            check_all_reduce(choice, backend)
    check_all_reduce("p2p", "gloo")
    with pytest.raises(ValueError, match="all_reduce='p2p' .* runs on gloo only; on nccl .* pass all_reduce='auto' or "
                       "'backend'"):
        check_all_reduce("p2p", "nccl")
    with pytest.raises(ValueError, match="all_reduce must be one of \\('auto', 'p2p', 'backend', 'backend_whole'\\), "
                       "got 'ring'"):
        check_all_reduce("ring", "gloo")


def _payload(rank: int, r: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * r + rank)) * 10 ** (rank % 3)


def _skew(rank: int, cut: bool = False) -> dict:
    """Each replica's own times: replica 0 alone saw ours faster; the others saw gloo's faster by more (cut: whole
    on one connection faster still)."""
    if rank == 0:
        return {P2P: [1.0], BACKEND: [2.0], BACKEND_WHOLE: [3.0] if cut else []}
    return {P2P: [3.0], BACKEND: [2.0 if cut else 1.0], BACKEND_WHOLE: [1.0] if cut else []}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=60)
    try:
        log = tiny.CallLog()
        log.install()
        t = TorchDistributedTransport(torch.device("cpu"))  # all_reduce="auto", the default
        fixed = TorchDistributedTransport(torch.device("cpu"), all_reduce="p2p")
        cut = TorchDistributedTransport(torch.device("cpu"), streams=2)  # every payload cut into two pieces
        whole = TorchDistributedTransport(torch.device("cpu"), streams=2, all_reduce="backend_whole")
        for transport in (t, fixed, cut, whole):
            transport.chunked_min_bytes = 0
        res: dict = {"calls": [], "sums": []}
        for r in range(ROUNDS):
            if r == len(TRIALS):  # before the times travel: what was measured, then each replica's own skew
                choice = t.choices[(0, 0, NUMEL)]
                res["measured"] = {a: list(s) for a, s in choice.seconds.items()}
                choice.seconds = _skew(rank)
            log.active = True
            res["sums"].append(t.all_reduce_sum(_payload(rank, r)).clone())
            log.active = False
            res["calls"].append([c[0] for c in log.take()])
        choice = t.choices[(0, 0, NUMEL)]
        res["chosen"], res["totals"] = choice.chosen, choice.totals
        res["kept"] = {a: list(s) for a, s in choice.seconds.items()}  # the trials' times only
        # the next round posted before the one carrying the times was waited for: it decides first, alike everywhere
        early = TorchDistributedTransport(torch.device("cpu"))
        early.chunked_min_bytes = 0
        for r in range(len(TRIALS)):
            early.all_reduce_sum(_payload(rank, r))
        early.choices[(0, 0, NUMEL)].seconds = _skew(rank)
        log.active = True
        carrying = early.start_all_reduce_sum(_payload(rank, 4))
        after = early.start_all_reduce_sum(_payload(rank, 5))
        res["early_decided"] = early.choices[(0, 0, NUMEL)].chosen  # before either was waited for
        res["early_sums"] = [carrying.wait().clone(), after.wait().clone()]
        res["early_calls"] = [c[0] for c in log.take()]
        log.active = False
        log.active = True
        for r in range(ROUNDS):
            fixed.all_reduce_sum(_payload(rank, r))
        res["fixed_calls"] = [c[0] for c in log.take()]
        res["cut_calls"], res["cut_sums"] = [], []
        for r in range(len(TRIALS_CUT) + 3):
            if r == len(TRIALS_CUT):
                res["cut_measured"] = {a: list(s) for a, s in cut.choices[(0, 0, NUMEL)].seconds.items()}
                cut.choices[(0, 0, NUMEL)].seconds = _skew(rank, cut=True)
            res["cut_sums"].append(cut.all_reduce_sum(_payload(rank, r)).clone())
            res["cut_calls"].append([c[0] for c in log.take()])
        res["cut_chosen"], res["cut_totals"] = cut.choices[(0, 0, NUMEL)].chosen, cut.choices[(0, 0, NUMEL)].totals
        # the payloads of the rounds the cut transport took whole: its two trials and a round after the decision
        res["whole_sums"] = [whole.all_reduce_sum(_payload(rank, r)).clone() for r in WHOLE_ROUNDS]
        res["whole_calls"] = [c[0] for c in log.take()]
        log.active = False
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_replica_takes_the_decision_of_the_summed_times_and_the_same_bits_every_round(tmp_path):
    world = 3
    start_ranks(_worker, world, args=(world, free_port(), str(tmp_path)), timeout_s=180)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    ours = ["batch_isend_irecv", "batch_isend_irecv"]  # the reduce-scatter, then the all-gather
    expected_calls = [ours, ["all_reduce"], ours, ["all_reduce"],
                      ["batch_isend_irecv"] + ours,  # the times first, then the payload, ours
                      ["all_reduce"], ["all_reduce"]]  # decided: gloo's (see the totals below)
    for rank in range(world):
        assert res[rank]["calls"] == expected_calls, rank
        measured = res[rank]["measured"]  # each tried twice, timed from posting to the sum
        assert len(measured[P2P]) == 2 and len(measured[BACKEND]) == 2 and min(measured[P2P] + measured[BACKEND]) > 0
        # p2p: 1 + 3 + 3 = 7 against backend: 2 + 1 + 1 = 4, summed in replica order on every replica
        assert res[rank]["chosen"] == BACKEND and res[rank]["totals"] == (7.0, 4.0, math.inf)
        assert res[rank]["kept"] == _skew(rank)  # the round that carried the times is not kept as a trial of ours
        assert res[rank]["fixed_calls"] == ours * ROUNDS  # all_reduce="p2p": never tried, never shared
        assert res[rank]["early_decided"] == BACKEND
        # the times, the carrying round's reduce-scatter, the next round (decided: gloo's), the carrying all-gather
        assert res[rank]["early_calls"] == ["batch_isend_irecv", "batch_isend_irecv", "all_reduce", "batch_isend_irecv"]
        for r, total in zip((4, 5), res[rank]["early_sums"]):
            assert torch.equal(total, res[0]["early_sums"][r - 4])
            expected = sum_in_group_order({i: _payload(i, r) for i in range(world)}, range(world))
            assert torch.allclose(total, expected, rtol=1e-5, atol=1e-4)
        for r in range(ROUNDS):
            assert torch.equal(res[rank]["sums"][r], res[0]["sums"][r]), (rank, r)  # the same bits everywhere
            expected = sum_in_group_order({i: _payload(i, r) for i in range(world)}, range(world))
            if expected_calls[r][-1] == "batch_isend_irecv":  # ours: the float32 sum in replica order, bitwise
                assert torch.equal(res[rank]["sums"][r], expected), (rank, r)
            else:
                assert torch.allclose(res[rank]["sums"][r], expected, rtol=1e-5, atol=1e-4), (rank, r)
        # the payload cut in two: gloo's side is two all-reduces (one per stream group), or one whole
        ours_cut = ours * 2  # each step's exchange, one batch per stream group
        cut_calls = [ours_cut, ["all_reduce"] * 2, ["all_reduce"], ours_cut, ["all_reduce"] * 2, ["all_reduce"],
                     ["batch_isend_irecv"] + ours_cut,  # the times (three float64), then the payload, ours
                     ["all_reduce"], ["all_reduce"]]  # decided: whole (p2p 7, cut 6, whole 5)
        assert res[rank]["cut_calls"] == cut_calls, rank
        assert all(len(s) == 2 and min(s) > 0 for s in res[rank]["cut_measured"].values()), res[rank]["cut_measured"]
        assert res[rank]["cut_chosen"] == BACKEND_WHOLE and res[rank]["cut_totals"] == (7.0, 6.0, 5.0)
        # all_reduce="backend_whole" fixes the decision: one all-reduce per round, never tried, never shared; the
        # same bits as the rounds the decision sent there
        assert res[rank]["whole_calls"] == ["all_reduce"] * len(WHOLE_ROUNDS)
        for r, total in zip(WHOLE_ROUNDS, res[rank]["whole_sums"]):
            assert torch.equal(total, res[rank]["cut_sums"][r]), (rank, r)
        for r, total in enumerate(res[rank]["cut_sums"]):
            assert torch.equal(total, res[0]["cut_sums"][r]), (rank, r)
            expected = sum_in_group_order({i: _payload(i, r) for i in range(world)}, range(world))
            assert torch.allclose(total, expected, rtol=1e-5, atol=1e-4), (rank, r)


def test_b7_times_only_rounds_after_the_decision():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.b7_torchft import SETTLE_ROUNDS

    # the longest trials and the round that carries their times go untimed
    assert SETTLE_ROUNDS == max(len(TRIALS), len(TRIALS_CUT)) + 1
