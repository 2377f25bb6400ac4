"""The training simulator: N replicas of a real module in one process.

The equivalence tests run the same seeds and shards through the Lightning strategies (real
processes, torch.distributed) and through the simulator, and compare every replica's weights after
every inner step.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.replica.options import WireConfig
from lightning_loco.simulator import TrainingSimulator, distributed_shards

import tiny

ALGORITHMS = {
    "noloco": lambda: NoLoCo(),
    "gasloc": lambda: GASLoC(topology="ring"),
    "diloco": lambda: DiLoCo(),
}
STRATEGY_KWARGS = {"noloco": {}, "gasloc": {"topology": "ring"}, "diloco": {}}


def simulate(n: int, algorithm, steps: int, h: int, batched, clip=None, scheduler=False,
             fragments: int = 1) -> list[list[torch.Tensor]]:
    """Every replica's flat weights after every step (as tiny.Recorder keeps them)."""
    module = tiny.TinyRegressor(lr=0.05, scheduler=scheduler)
    shards = distributed_shards(tiny.dataset(), n, batch_size=4, shuffle=True, seed=0)
    sim = TrainingSimulator(module, shards, algorithm, sync_every=h, gradient_clip_val=clip, batched=batched,
                            max_steps=steps, fragments=fragments)
    history = []
    for _ in range(steps):
        sim.step()
        history.append(sim.weights())
    sim.finish()
    return history


@pytest.mark.parametrize(
    ("name", "n", "batched"),
    [("noloco", 2, True), ("gasloc", 2, False), ("diloco", 2, True), ("noloco", 4, False), ("gasloc", 4, True),
     ("diloco", 4, False)],
)
def test_the_simulator_follows_the_multiprocess_strategy_step_by_step(tmp_path, name, n, batched):
    h, steps = 3, 9
    kwargs = {"sync_every": h, **STRATEGY_KWARGS[name]}
    recs = tiny.launch(tmp_path, strategy=name, strategy_kwargs=kwargs, devices=n, max_steps=steps, clip=0.5,
                       scheduler=True)
    history = simulate(n, ALGORITHMS[name](), steps, h, batched, clip=0.5, scheduler=True)
    for step in range(steps):
        for r in range(n):
            torch.testing.assert_close(history[step][r], recs[r]["weights"][step], atol=2e-6, rtol=1e-5,
                                       msg=lambda m, r=r, step=step: f"{name}, replica {r}, step {step}: {m}")
    # the replicas really trained apart and met: not all identical, not all different after a round
    assert not torch.equal(history[h - 2][0], history[h - 2][1])


def test_the_simulator_with_fragments_follows_the_multiprocess_strategy_step_by_step(tmp_path):
    # N = 4, H = 4, F = 2: fragment 0's rounds at steps 4 and 8, fragment 1's at 2 and 6, each fragment
    # meeting its own random peers; step 9 ends fit, so both fragments start a final round there
    n, h, steps, fragments = 4, 4, 9, 2
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": h, "fragments": fragments},
                       devices=n, max_steps=steps)
    history = simulate(n, NoLoCo(), steps, h, True, fragments=fragments)
    for step in range(steps):
        for r in range(n):
            torch.testing.assert_close(history[step][r], recs[r]["weights"][step], atol=2e-6, rtol=1e-5,
                                       msg=lambda m, r=r, step=step: f"replica {r}, step {step}: {m}")
    assert not torch.equal(history[0][0], history[0][1])  # the replicas trained apart
    whole = simulate(n, NoLoCo(), steps, h, True)  # F = 1: no round before step 4
    assert torch.equal(whole[0][0], history[0][0]) and not torch.equal(whole[1][0], history[1][0])


def test_a_final_landing_can_be_taken_back_and_training_goes_on_as_if_it_never_happened():
    def make():
        return TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), 2, 4), NoLoCo(), sync_every=2)

    plain, probed = make(), make()
    plain.run(2)
    probed.step()
    probed.step(last=True)  # lands as the end of training: the pair's mean, no momentum extrapolation
    kept = probed.outer_weights()
    assert kept is not None and plain.outer_weights() is None
    for w, k in zip(probed.weights(), kept):
        assert not torch.allclose(w, k)
    for a, b in zip(kept, plain.weights()):  # kept aside: what the plain outer step gave
        torch.testing.assert_close(a, b)
    ev = probed.evaluate([tiny.dataset()[:16]], weights=kept)
    assert ev.consensus_loss == pytest.approx(plain.evaluate([tiny.dataset()[:16]]).consensus_loss, rel=1e-6)
    plain.run(3)
    probed.run(3)  # the next step starts from the outer step's own weights
    for a, b in zip(plain.weights(), probed.weights()):
        torch.testing.assert_close(a, b)


def test_with_fragments_the_end_lands_every_fragment_and_keeps_the_outer_steps_weights_of_each():
    sim = TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), 2, 4), NoLoCo(), sync_every=4,
                            fragments=2)
    sim.run(2)  # fragment 1's round at step 2
    sim.step(last=True)  # step 3: no round due, the end starts one of each fragment
    assert [(r.fragment, r.final) for r in sim.drivers[0].reports] == [(1, False), (0, True), (1, True)]
    kept = sim.outer_weights()
    assert kept is not None and all(not torch.equal(w, k) for w, k in zip(sim.weights(), kept))
    for driver in sim.drivers:
        driver.restore_outer_weights()
    for w, k in zip(sim.weights(), kept):  # joined in the replica's parameter order
        assert torch.equal(w, k)


def test_batched_and_looped_paths_agree():
    a = simulate(4, NoLoCo(), 8, 2, batched=True)
    b = simulate(4, NoLoCo(), 8, 2, batched=False)
    for step in range(8):
        for r in range(4):
            torch.testing.assert_close(a[step][r], b[step][r], atol=1e-6, rtol=1e-5)


def test_gradient_averaging_is_ddp_one_model_with_the_mean_gradient():
    n, steps = 3, 6
    shards = [list(s) for s in distributed_shards(tiny.dataset(), n, batch_size=4, shuffle=True, seed=0)]
    sim = TrainingSimulator(tiny.TinyRegressor(), shards, None, gradient_averaging=True)
    model = tiny.TinyRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        sim.step()
        opt.zero_grad()
        for r in range(n):
            (model.loss(shards[r][step % len(shards[r])]) / n).backward()
        opt.step()
        for w in sim.weights():
            torch.testing.assert_close(w, tiny.flat(model), atol=1e-6, rtol=1e-5)
    per_step = 2 * (n - 1) * tiny.flat(model).numel() * 4 // n
    assert sim.bytes_sent() == [per_step * steps] * n


def test_independent_replicas_never_meet_and_send_nothing():
    sim = TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), 2, 4), None, sync_every=2)
    sim.run(6)
    a, b = sim.weights()
    assert not torch.allclose(a, b)
    assert sim.bytes_sent() == [0, 0]
    assert sim.spread() > 0


def test_bytes_spread_and_evaluation():
    n = 4
    sim = TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), n, 4), NoLoCo(), sync_every=2)
    sim.run(4)
    numel = tiny.flat(sim.replicas[0]).numel()
    assert sim.bytes_sent() == [2 * numel * 4] * n  # two rounds, one model copy to one peer each
    weights = torch.stack(sim.weights())
    expected = (weights - weights.mean(0)).pow(2).sum(1).mean().sqrt().item()
    assert sim.spread() == pytest.approx(expected)
    batches = [tiny.dataset()[:16]]
    ev = sim.evaluate(batches)
    for r in range(n):
        assert ev.replica_losses[r] == pytest.approx(sim.replicas[r].loss(batches[0]).item(), rel=1e-6)
    consensus = copy.deepcopy(sim.replicas[0])
    torch.nn.utils.vector_to_parameters(weights.mean(0), consensus.parameters())
    assert ev.consensus_loss == pytest.approx(consensus.loss(batches[0]).item(), rel=1e-6)
    assert ev.mean_replica_loss == pytest.approx(sum(ev.replica_losses) / n)
    assert all(r.peer_distance is not None for d in sim.drivers for r in d.reports)


def test_overlapped_rounds_land_and_finish_lands_the_last_one():
    sim = TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), 2, 4), NoLoCo(),
                            sync_every=4, overlap_steps=2)
    sim.run(8)  # the round started at step 8 lands at step 10, or at finish()
    assert [r.outer_step for r in sim.drivers[0].reports] == [0]
    sim.finish()
    assert [r.outer_step for r in sim.drivers[0].reports] == [0, 1]


def test_a_module_with_batchnorm_falls_back_to_the_loop_with_a_warning():
    with pytest.warns(UserWarning, match="batched path is not available"):
        sim = TrainingSimulator(tiny.TinyRegressor(batchnorm=True), distributed_shards(tiny.dataset(), 2, 4),
                                NoLoCo(), sync_every=2)
    assert not sim.batched
    sim.run(2)
    with pytest.raises(ValueError, match="BatchNorm"):
        TrainingSimulator(tiny.TinyRegressor(batchnorm=True), distributed_shards(tiny.dataset(), 2, 4), batched=True)


def test_dropout_each_replica_draws_from_its_own_rng_stream_in_the_loop():
    class Drop(tiny.TinyRegressor):
        def forward(self, x):
            return self.head(nn.functional.dropout(torch.tanh(self.body(x)), 0.5, self.training))

    torch.manual_seed(7)
    start = torch.get_rng_state()  # every rank is seeded alike
    shards = [list(s) for s in distributed_shards(tiny.dataset(), 2, 4)]
    sim = TrainingSimulator(Drop(), shards, None, batched=False)
    torch.manual_seed(99)  # the global stream does not leak into the replicas'
    sim.run(3)
    for r in range(2):  # replica r's stream advanced by its own three forward passes only, as in a process
        torch.set_rng_state(start)
        model = Drop()
        for step in range(3):
            model.loss(shards[r][step])
        assert torch.equal(sim.rng_states[r], torch.get_rng_state())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainingSimulator(Drop(), shards, None, batched=True).run(2)  # randomness="different" under vmap


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"batched": "yes"}, "batched"), ({"sync_every": 0}, "sync_every"), ({"gradient_clip_val": -1.0}, "clip"),
     ({"gradient_averaging": True, "algorithm": NoLoCo()}, "gradient_averaging"),
     ({"fragments": 3, "sync_every": 4, "algorithm": NoLoCo()}, "fragments=3 must divide sync_every=4"),
     ({"fragments": 2, "sync_every": 4}, "fragments configure the outer step: give an algorithm with them"),
     ({"fragments": 2, "sync_every": 4, "algorithm": NoLoCo(), "step_seconds": [1.0, 2.0]},
      "Use fragments=1 with step_seconds"),
     ({"algorithm": NoLoCo(), "wire": WireConfig(streams=4)}, "Use streams=1 in the simulator")],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), 2, 4), **kwargs)


def test_a_batchnorm_models_consensus_is_the_strategies_with_its_running_statistics_averaged(tmp_path):
    """A BatchNorm model, N = 4, trained 6 steps (two rounds): the simulator's consensus loss is the real run's
    ``val/loss_consensus`` (validated at step 6 with the replicas' average swapped in, buffers included), and its
    consensus buffers are what every rank holds after fit's average."""
    import csv

    n, h, steps = 4, 3, 6
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": h}, devices=n, max_steps=steps,
                       batchnorm=True, val_check_interval=steps, monitor={"consensus_validation": True})
    module = tiny.TinyRegressor(lr=0.05, batchnorm=True)
    shards = distributed_shards(tiny.dataset(), n, batch_size=4, shuffle=True, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNorm model falls back to the loop, with a warning
        sim = TrainingSimulator(module, shards, NoLoCo(), sync_every=h, max_steps=steps)
        for _ in range(steps):
            sim.step()
    for r in range(n):
        torch.testing.assert_close(sim.weights()[r], recs[r]["weights"][-1], atol=2e-6, rtol=1e-5)
    batches = list(torch.utils.data.DataLoader(tiny.dataset(), batch_size=4))
    simulated = sim.evaluate(batches).consensus_loss
    with open(tmp_path / "out" / "csv" / "version_0" / "metrics.csv") as f:
        logged = [float(row["val/loss_consensus"]) for row in csv.DictReader(f) if row.get("val/loss_consensus")]
    assert logged and simulated == pytest.approx(logged[-1], rel=1e-5)
    # the buffers: the running statistics averaged over the replicas, as fit's end leaves every rank
    after = torch.load(tmp_path / "out" / "after_fit0.pt")
    consensus = sim.consensus_buffers()
    assert set(after["buffers"]) == {"norm.running_mean", "norm.running_var"}
    for name, value in after["buffers"].items():
        torch.testing.assert_close(consensus[name], value, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(value, dict(module.named_buffers())[name])  # moved from the module's init
    assert consensus["norm.num_batches_tracked"] == steps  # an integer buffer is replica 0's, not averaged


def test_a_replica_that_raises_in_a_round_stops_its_peers_waits_at_once(monkeypatch):
    """A replica's error in its round (here: as it posts its exchange) is raised as it is, at once: its peers,
    waiting for what it never posts, fail then instead of at the in-process network's timeout."""
    sim = TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), 3, 4), NoLoCo(), sync_every=2)
    assert sim.network is not None
    sim.network.timeout = 120.0  # without the early stop: a PeerError after this, and the test fails

    def broken(*args, **kwargs):
        raise ValueError("replica 1 could not post")

    monkeypatch.setattr(sim.drivers[1].transport, "start_group_sum", broken)
    with pytest.raises(ValueError, match="replica 1 could not post"):
        sim.run(2)
    assert 1 in sim.network._failed
