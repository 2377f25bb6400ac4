"""Real multi-process runs through ``Trainer(strategy=...)`` (gloo, CPU, 1 to 4 processes).

Each run is ``python tests/tiny.py`` in a subprocess (Lightning's popen launcher re-runs that command
for every rank). The results are checked against a reference written here from the spec's formulas.
"""

import pytest
import torch

from lightning_loco.algorithms import GASLoC
from lightning_loco.algorithms.schedules import random_groups

import tiny

run = tiny.launch
# The references below run the papers' outer step at every round, the last included: runs compared
# with them that end on an outer step ask for it too (the default lands that round without momentum).
PAPERS = {"final_outer_step": "outer"}


def reference(replicas, steps, sync_every, outer, lr=0.05, ranks_per_replica=1):
    """Every replica's weights after every step: inner SGD on its shard, outer step by the formula.

    With ``ranks_per_replica`` = k > 1 a replica is ONE model whose batch is the union of its k ranks'
    batches (each rank reads its own shard of a DistributedSampler over all ranks; DDP averages the
    ranks' gradients, which for equal batch sizes is the gradient of the mean loss)."""
    world = replicas * ranks_per_replica
    modules = [tiny.TinyRegressor(lr) for _ in range(replicas)]
    data = tiny.dataset()
    per_epoch = len(tiny.shard_batches(0, world, 4, 0))
    params = [list(m.parameters()) for m in modules]
    state = {"anchor": [tiny.flat(modules[0]).double()] * replicas, "momentum": [0.0] * replicas, "t": 0}
    history = [[] for _ in range(replicas)]
    for step in range(steps):
        for a in range(replicas):
            losses = []
            for r in range(a * ranks_per_replica, (a + 1) * ranks_per_replica):
                x, y = data[tiny.shard_batches(r, world, 4, step // per_epoch)[step % per_epoch]]
                losses.append(modules[a].loss((x, y)))
            modules[a].zero_grad()
            (sum(losses) / len(losses)).backward()
            with torch.no_grad():
                for p in params[a]:
                    p -= lr * p.grad
        if (step + 1) % sync_every == 0:
            thetas = [tiny.flat(m).double() for m in modules]
            anchors = outer(state, thetas)
            for a in range(replicas):
                torch.nn.utils.vector_to_parameters(anchors[a].float(), params[a])
            state["t"] += 1
        for a in range(replicas):
            history[a].append(tiny.flat(modules[a]))
    return history


def noloco_outer(alpha, beta, gamma, group_size, seed=0):
    def outer(state, thetas):
        n = len(thetas)
        phi, delta = state["anchor"], state["momentum"]
        new_phi, new_delta = list(phi), list(delta)
        for g in random_groups(n, group_size, seed, state["t"]).groups:
            d_bar = sum(thetas[j] - phi[j] for j in g) / len(g)
            phi_bar = sum(phi[j] for j in g) / len(g)
            for i in g:
                new_delta[i] = alpha * delta[i] + beta * d_bar - gamma * (phi[i] - phi_bar)
                new_phi[i] = phi[i] + new_delta[i]
        state["anchor"], state["momentum"] = new_phi, new_delta
        return new_phi

    return outer


def diloco_outer(lr=0.7, mu=0.9):
    def outer(state, thetas):
        n = len(thetas)
        phi = state["anchor"][0]
        g = phi - sum(thetas) / n
        buf = g if state["t"] == 0 else mu * state["momentum"] + g
        state["momentum"] = buf
        phi = phi - lr * (g + mu * buf)  # Nesterov
        state["anchor"] = [phi] * n
        return state["anchor"]

    return outer


def gasloc_outer(eta, gamma, alpha, topology):
    schedule = GASLoC(topology=topology).schedule  # the schedule itself is tested in test_gasloc.py

    def outer(state, thetas):
        n = len(thetas)
        anchors = state["anchor"]
        x_prev = state.get("x_prev", anchors)
        z = [a + eta * (th - a) for a, th in zip(anchors, thetas)]
        new, prev = list(anchors), list(x_prev)
        for g in schedule(state["t"], n).groups:
            for i in g:
                x = z[i] - alpha * sum(z[i] - z[j] for j in g if j != i)
                new[i], prev[i] = x + gamma * (x - x_prev[i]), x
        state["anchor"], state["x_prev"] = new, prev
        return new

    return outer


def assert_follows(records, expected, atol=2e-5):
    for r, rec in enumerate(records):
        assert len(rec["weights"]) == len(expected[r])
        for step, (got, want) in enumerate(zip(rec["weights"], expected[r])):
            assert torch.allclose(got.double(), want.double(), atol=atol), (r, step, got, want)


def outer_step_batches(record):
    return [i for i, calls in enumerate(record["calls"]) if calls]


def test_noloco_two_replicas_follow_the_hand_trajectory_and_talk_only_to_each_other(tmp_path):
    h, steps = 3, 9
    recs = run(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": h, **PAPERS}, devices=2, max_steps=steps)
    assert torch.equal(recs[0]["initial"], recs[1]["initial"])  # replicas start identical
    assert not torch.equal(recs[0]["weights"][0], recs[1]["weights"][0])  # then train apart
    assert_follows(recs, reference(2, steps, h, noloco_outer(0.5, 0.7, 0.7, 2)))
    numel = recs[0]["outer_states"][0]["numel"]
    for r, rec in enumerate(recs):
        assert outer_step_batches(rec) == [2, 5, 8]
        for i in outer_step_batches(rec):
            # exactly one point-to-point batch, receive posted before send, one model copy each way
            assert rec["calls"][i] == [("batch_isend_irecv", (("irecv", 1 - r, numel), ("isend", 1 - r, numel)))]
        assert rec["outer_states"][0]["anchor_dtype"] == "torch.float32"


def test_wire_streams_spread_each_exchange_over_groups_and_keep_the_trajectory(tmp_path):
    """``WireConfig(streams=3)``: every exchange is three point-to-point batches, one per process group, each a
    third of the model; the weights are bitwise those of one stream (the same sums, cut in pieces)."""
    h, steps = 3, 6
    one = run(tmp_path / "one", strategy="noloco", strategy_kwargs={"sync_every": h, **PAPERS}, devices=2,
              max_steps=steps)
    three = run(tmp_path / "three", strategy="noloco",
                strategy_kwargs={"sync_every": h, **PAPERS, "wire": {"streams": 3}}, devices=2, max_steps=steps)
    numel = one[0]["outer_states"][0]["numel"]
    pieces = [len(t) for t in torch.tensor_split(torch.empty(numel), 3)]
    for r in range(2):
        assert len(one[r]["weights"]) == len(three[r]["weights"]) == steps
        assert all(torch.equal(a, b) for a, b in zip(one[r]["weights"], three[r]["weights"]))
        assert outer_step_batches(three[r]) == [2, 5]
        for i in outer_step_batches(three[r]):
            assert three[r]["calls"][i] == [("batch_isend_irecv", (("irecv", 1 - r, n), ("isend", 1 - r, n)))
                                            for n in pieces]


@pytest.mark.slow
def test_noloco_three_replicas_general_gamma(tmp_path):
    # N = 3 with pairs: the last group takes the remainder, so one group of three. γ ≠ β: θ and φ travel.
    h, steps = 2, 6
    kwargs = {"sync_every": h, "averaging_rate": 0.9, **PAPERS}
    recs = run(tmp_path, strategy="noloco", strategy_kwargs=kwargs, devices=3, max_steps=steps)
    assert_follows(recs, reference(3, steps, h, noloco_outer(0.5, 0.7, 0.9, 2)))
    numel = recs[0]["outer_states"][0]["numel"]
    for r, rec in enumerate(recs):
        for i in outer_step_batches(rec):
            (name, ops), = rec["calls"][i]
            peers = sorted({p for _, p, _ in ops})
            assert name == "batch_isend_irecv" and peers == sorted({0, 1, 2} - {r})
            assert [op for op, _, _ in ops] == ["irecv", "irecv", "isend", "isend"]
            assert all(n == 2 * numel for _, _, n in ops)
        assert outer_step_batches(rec) == [1, 3, 5]
    for i in (1, 3, 5):
        assert torch.equal(recs[0]["weights"][i], recs[1]["weights"][i])
        assert torch.equal(recs[0]["weights"][i], recs[2]["weights"][i])


@pytest.mark.slow
def test_noloco_four_replicas_by_registered_name_with_paper_defaults(tmp_path):
    steps = 100  # H = 50 by default: two outer steps
    recs = run(tmp_path, strategy="noloco", strategy_kwargs=PAPERS, devices=4, max_steps=steps)
    assert all(rec["strategy"] == "NoLoCoStrategy" for rec in recs)
    assert_follows(recs, reference(4, steps, 50, noloco_outer(0.5, 0.7, 0.7, 2)), atol=1e-4)
    for r, rec in enumerate(recs):
        assert outer_step_batches(rec) == [49, 99]
        for t, i in enumerate(outer_step_batches(rec)):
            (peer,) = random_groups(4, 2, 0, t).peers_of(r)
            assert [(op, p) for op, p, _ in rec["calls"][i][0][1]] == [("irecv", peer), ("isend", peer)]
            assert len(rec["calls"][i]) == 1
    # after an outer step, partners of that round differ from non-partners in general
    final = [rec["weights"][-1] for rec in recs]
    assert not all(torch.equal(final[0], w) for w in final[1:])


def test_diloco_four_replicas_identical_after_each_outer_step(tmp_path):
    h, steps = 4, 8
    recs = run(tmp_path, strategy="diloco", strategy_kwargs={"sync_every": h, **PAPERS}, devices=4, max_steps=steps)
    assert_follows(recs, reference(4, steps, h, diloco_outer()))
    for step in range(steps):
        same = all(torch.equal(recs[0]["weights"][step], rec["weights"][step]) for rec in recs[1:])
        assert same == ((step + 1) % h == 0), step
    for rec in recs:
        assert outer_step_batches(rec) == [3, 7]
        assert all(rec["calls"][i] == [("all_reduce",)] for i in (3, 7))


@pytest.mark.slow
def test_single_replica_runs_with_no_communication(tmp_path):
    h, steps = 2, 6
    recs = run(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": h, **PAPERS}, devices=1, max_steps=steps)
    assert_follows(recs, reference(1, steps, h, noloco_outer(0.5, 0.7, 0.7, 2)))
    assert outer_step_batches(recs[0]) == []
    assert recs[0]["outer_states"][0]["outer_steps"] == 3


@pytest.mark.slow
def test_outer_steps_count_optimizer_steps_with_accumulation_clipping_and_bf16_mixed(tmp_path):
    recs = run(
        tmp_path, strategy="noloco", strategy_kwargs={"sync_every": 2}, devices=2, max_steps=6,
        accumulate=2, clip=0.5, precision="bf16-mixed",
    )
    for rec in recs:
        # 12 batches, an optimizer step every 2 batches, an outer step every 2 optimizer steps
        assert len(rec["weights"]) == 12
        assert outer_step_batches(rec) == [3, 7, 11]
        assert rec["outer_states"][0]["inner_steps"] == 6 and rec["outer_states"][0]["outer_steps"] == 3


@pytest.mark.slow
def test_manual_optimization_with_two_optimizers_and_bf16_true(tmp_path):
    recs = run(
        tmp_path, strategy="diloco", strategy_kwargs={"sync_every": 2}, devices=2, max_steps=8,
        manual=True, precision="bf16-true",
    )
    for rec in recs:
        assert rec["param_dtypes"] == ["torch.bfloat16"]
        body, head = rec["outer_states"]
        assert (body["numel"], head["numel"]) == (15, 4)  # each optimizer has its own outer state
        assert body["anchor_dtype"] == head["anchor_dtype"] == "torch.float32"
        assert body["inner_steps"] == head["inner_steps"] == body["outer_steps"] * 2
        # each outer step all-reduces once per optimizer: with two replicas on gloo, one pair exchange each
        assert sum(len(c) for c in rec["calls"]) == body["outer_steps"] + head["outer_steps"]
        assert {name for c in rec["calls"] for (name, *_) in c} == {"batch_isend_irecv"}
    for i in outer_step_batches(recs[0]):
        assert torch.equal(recs[0]["weights"][i], recs[1]["weights"][i])


@pytest.mark.slow
def test_the_call_counter_sees_lightnings_per_batch_broadcast_under_plain_ddp(tmp_path):
    # Control for the tests above: the counter is not blind; plain DDP broadcasts every batch.
    recs = run(tmp_path, strategy="ddp", devices=2, max_steps=4)
    for rec in recs:
        assert all(("broadcast",) in calls for calls in rec["calls"][1:])


@pytest.mark.slow
def test_validate_after_fit_keeps_every_replica_its_own_weights(tmp_path):
    kwargs = {"sync_every": 4, "average_at_end": False}
    recs = run(tmp_path, strategy="noloco", strategy_kwargs=kwargs, devices=2, max_steps=6, then_validate=True)
    assert not torch.equal(recs[0]["weights"][-1], recs[1]["weights"][-1])  # mid-phase: replicas differ
    for r, rec in enumerate(recs):
        after = torch.load(tmp_path / "out" / f"after_validate{r}.pt")
        assert torch.equal(after, rec["weights"][-1])  # not overwritten by rank 0's replica


@pytest.mark.slow
def test_gasloc_random_pairs_four_replicas(tmp_path):
    h, steps = 3, 9
    kwargs = {"sync_every": h, "outer_lr": 0.8, "outer_momentum": 0.6, "gossip_step": 0.3, **PAPERS}
    recs = run(tmp_path, strategy="gasloc", strategy_kwargs=kwargs, devices=4, max_steps=steps)
    assert_follows(recs, reference(4, steps, h, gasloc_outer(0.8, 0.6, 0.3, "random_pairs")))
    schedule = GASLoC().schedule
    for r, rec in enumerate(recs):
        assert outer_step_batches(rec) == [2, 5, 8]
        for t, i in enumerate(outer_step_batches(rec)):
            (peer,) = schedule(t, 4).peers_of(r)
            numel = rec["outer_states"][0]["numel"]  # only z travels: one model copy each way
            assert rec["calls"][i] == [("batch_isend_irecv", (("irecv", peer, numel), ("isend", peer, numel)))]


@pytest.mark.slow
def test_gasloc_ring_with_odd_replicas_lets_one_sit_out(tmp_path):
    h, steps = 2, 6
    recs = run(tmp_path, strategy="gasloc", strategy_kwargs={"sync_every": h, "topology": "ring", **PAPERS},
               devices=3, max_steps=steps)
    assert_follows(recs, reference(3, steps, h, gasloc_outer(0.7, 0.5, 0.25, "ring")))
    # ring on 3 replicas: round 0 pairs (0, 1) and 2 sits out; round 1 pairs (1, 2) and 0 sits out
    assert [len(recs[2]["calls"][i]) for i in (1, 3, 5)] == [0, 1, 0]
    assert [len(recs[0]["calls"][i]) for i in (1, 3, 5)] == [1, 0, 1]


@pytest.mark.slow
def test_complete_gasloc_follows_diloco_with_the_same_outer_sgd(tmp_path):
    h, steps, eta, gamma = 2, 8, 0.7, 0.9
    kwargs = {"sync_every": h, "outer_lr": eta, "outer_momentum": gamma, **PAPERS}  # the identity of the papers' step
    gasloc = run(tmp_path / "g", strategy="gasloc", strategy_kwargs={**kwargs, "topology": "complete"}, devices=3,
                 max_steps=steps)
    diloco = run(tmp_path / "d", strategy="diloco", strategy_kwargs=kwargs, devices=3, max_steps=steps)
    for g, d in zip(gasloc, diloco):
        assert all(calls in ([], [("all_reduce",)]) for calls in g["calls"])
        for a, b in zip(g["weights"], d["weights"]):
            assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_a_second_fit_of_the_same_model_starts_from_the_replicas_average(tmp_path):
    steps = 5  # ends mid-phase, replicas differ
    kwargs = {"sync_every": 3, "average_at_end": False}
    recs = run(tmp_path, strategy="noloco", strategy_kwargs=kwargs, devices=2, max_steps=steps, fit_twice=True)
    ends = [rec["weights"][steps - 1] for rec in recs]
    assert not torch.equal(ends[0], ends[1])
    for rec in recs:
        assert len(rec["starts"]) == 2
        assert torch.allclose(rec["starts"][1], (ends[0] + ends[1]) / 2, atol=1e-6)
