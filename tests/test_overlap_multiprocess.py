"""Overlap in real multi-process runs (gloo, CPU): the landing step, the merge against a hand
computation, the spec's anchor identities for τ > 0, the end of fit, an interrupted fit, and a peer
that fails while a round is in flight. The driver's overlap logic without processes (no blocking
before the landing, auto τ, failures) is in ``test_driver.py``."""

import csv
import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_loco.algorithms.schedules import random_groups
from lightning_loco.testing.launch import free_port, init_gloo, start_ranks
from lightning_loco.transport import PeerError, TorchDistributedTransport

import tiny

run = tiny.launch


def after_fit(tmp_path, rank):
    return torch.load(tmp_path / "out" / f"after_fit{rank}.pt")


def batches_with_calls(record):
    return [i for i, calls in enumerate(record["calls"]) if calls]


def noloco_overlap_reference(world, steps, h, tau, merge, alpha=0.5, beta=0.7, lr=0.05):
    """Every replica's weights after every step, written from the spec: inner SGD on its shard; at
    s = tH the snapshot S is sent and θ ← φ̂ (predict_correct) or left alone (delayed); τ steps later
    the synchronous outer step of the snapshots commits φ⁺ and the live weights are merged."""
    modules = [tiny.TinyRegressor(lr) for _ in range(world)]
    data = tiny.dataset()
    per_epoch = len(tiny.shard_batches(0, world, 4, 0))
    params = [list(m.parameters()) for m in modules]
    phi = [tiny.flat(modules[0]).double()] * world
    delta = [torch.zeros_like(phi[0])] * world
    pending, t, history = None, 0, [[] for _ in range(world)]

    def set_live(r, value):
        torch.nn.utils.vector_to_parameters(value.float(), params[r])

    for step in range(1, steps + 1):
        for r in range(world):
            x, y = data[tiny.shard_batches(r, world, 4, (step - 1) // per_epoch)[(step - 1) % per_epoch]]
            modules[r].zero_grad()
            modules[r].loss((x, y)).backward()
            with torch.no_grad():
                for p in params[r]:
                    p -= lr * p.grad
        if pending is not None and step == pending["land"]:
            snaps, proxies, groups = pending["S"], pending["proxy"], pending["groups"]
            new_phi, new_delta = list(phi), list(delta)
            for g in groups:
                mean_theta = sum(snaps[j] for j in g) / len(g)
                for i in g:
                    new_delta[i] = alpha * delta[i] + beta * (mean_theta - phi[i])  # γ = β
                    new_phi[i] = phi[i] + new_delta[i]
            phi, delta = new_phi, new_delta
            for r in range(world):
                live = tiny.flat(modules[r]).double()
                if merge == "predict_correct":
                    set_live(r, live + (phi[r] - proxies[r]))
                else:
                    set_live(r, phi[r] + (live - snaps[r]))
            pending = None
        if step % h == 0:
            snaps = [tiny.flat(m).double() for m in modules]
            proxies = [phi[r] + alpha * delta[r] + beta * (snaps[r] - phi[r]) for r in range(world)]
            pending = {"land": step + tau, "S": snaps, "proxy": proxies,
                       "groups": random_groups(world, 2, 0, t).groups}
            t += 1
            if merge == "predict_correct":
                for r in range(world):
                    set_live(r, proxies[r])
        for r in range(world):
            history[r].append(tiny.flat(modules[r]))
    return history


@pytest.mark.slow
def test_tau_zero_is_the_synchronous_strategy_bit_for_bit(tmp_path):
    common = {"strategy": "noloco", "devices": 2, "max_steps": 9}
    sync = run(tmp_path / "sync", strategy_kwargs={"sync_every": 3}, **common)
    zero = run(tmp_path / "zero", strategy_kwargs={"sync_every": 3, "overlap_steps": 0}, **common)
    for a, b in zip(sync, zero):
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
        assert a["calls"] == b["calls"]
        assert all(r["overlap_steps"] == 0 for r in b["reports"])


@pytest.mark.parametrize("merge", ["predict_correct", "delayed"])
def test_noloco_lands_tau_steps_later_with_the_specs_merge(tmp_path, merge):
    h, tau, steps = 4, 2, 11
    kwargs = {"sync_every": h, "overlap_steps": tau, "overlap_merge": merge, "average_at_end": False}
    recs = run(tmp_path, strategy="noloco", strategy_kwargs=kwargs, devices=2, max_steps=steps)
    expected = noloco_overlap_reference(2, steps, h, tau, merge)
    for r, rec in enumerate(recs):
        for step, (got, want) in enumerate(zip(rec["weights"], expected[r])):
            assert torch.allclose(got.double(), want.double(), atol=2e-5), (merge, r, step)
        # the exchange is posted at the start only (one batch_isend_irecv); the landing sends nothing
        assert batches_with_calls(rec) == [h - 1, 2 * h - 1]
        assert [(x["outer_step"], x["inner_step"], x["overlap_steps"]) for x in rec["reports"]] == [
            (0, h + tau, tau), (1, 2 * h + tau, tau)]
        assert rec["outer_states"][0]["outer_steps"] == 2
    assert not torch.equal(recs[0]["weights"][h], recs[1]["weights"][h])


def mean(tensors):
    return sum(t.double() for t in tensors) / len(tensors)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,h,tau", [("noloco", 3, 1), ("diloco", 4, 2), ("gasloc", 4, 3)])
def test_anchor_identities_hold_with_overlap(tmp_path, algorithm, h, tau):
    steps = 3 * h
    kwargs = {"sync_every": h, "overlap_steps": tau, "average_at_end": False}
    recs = run(tmp_path, strategy=algorithm, strategy_kwargs=kwargs, devices=4, max_steps=steps)
    rounds = [k * h + tau for k in range(1, 3)]  # landings inside the run (1-based steps)
    anchors = [[rec["initial"].double()] + [rec["anchors"][s - 1].double() for s in rounds] for rec in recs]
    snaps = [[s.double() for s in rec["snapshots"]] for rec in recs]
    for r in range(4):  # the last round started at the last step and landed when fit ended
        assert [x["inner_step"] for x in after_fit(tmp_path, r)["reports"]] == rounds + [steps]
    if algorithm == "noloco":
        # the mean anchor follows heavy-ball DiLoCo on the mean pseudo-gradient of the snapshots
        previous = mean([a[0] for a in anchors])
        for t in range(2):
            m_now = mean([a[t] for a in anchors])
            step = 0.5 * (m_now - previous) + 0.7 * mean([snaps[r][t] - anchors[r][t] for r in range(4)])
            assert torch.allclose(mean([a[t + 1] for a in anchors]), m_now + step, atol=1e-5), t
            previous = m_now
    elif algorithm == "diloco":
        phi, buf = anchors[0][0], None
        for t in range(2):
            assert all(torch.equal(a[t + 1], anchors[0][t + 1]) for a in anchors)  # one shared anchor
            g = phi - mean([snaps[r][t] for r in range(4)])
            buf = g if buf is None else 0.9 * buf + g
            phi = phi - 0.7 * (g + 0.9 * buf)
            assert torch.allclose(anchors[0][t + 1], phi, atol=1e-5), t
    else:
        # the matchings are doubly stochastic: the mean anchor follows Nesterov DiLoCo on the mean
        x_prev = mean([a[0] for a in anchors])
        for t in range(2):
            x = mean([anchors[r][t] + 0.7 * (snaps[r][t] - anchors[r][t]) for r in range(4)])
            assert torch.allclose(mean([a[t + 1] for a in anchors]), x + 0.5 * (x - x_prev), atol=1e-5), t
            x_prev = x


@pytest.mark.slow
def test_the_end_of_fit_lands_the_round_in_flight_and_the_monitor_logs_overlap(tmp_path):
    h = 4
    kwargs = {"sync_every": h, "overlap_steps": 2}
    recs = run(tmp_path, strategy="noloco", strategy_kwargs=kwargs, devices=2, max_steps=2 * h + 1,
               monitor={"spread_every": 1, "consensus_validation": False})
    ends = [after_fit(tmp_path, r) for r in range(2)]
    for end in ends:
        assert [(x["outer_step"], x["inner_step"], x["overlap_steps"]) for x in end["reports"]] == [
            (0, h + 2, 2), (1, 2 * h + 1, 1)]  # the second round landed when fit ended, one step in
        assert all(x["correction_norm"] > 0 for x in end["reports"]) and end["slots_left"] == 0
    assert torch.equal(ends[0]["weights"], ends[1]["weights"])  # then average_at_end
    assert not torch.equal(ends[0]["weights"], recs[0]["weights"][-1])

    rows = list(csv.DictReader(open(tmp_path / "out" / "csv" / "version_0" / "metrics.csv")))
    landed = [r for r in rows if r.get("outer/overlap_steps")]
    assert [float(r["outer/overlap_steps"]) for r in landed] == [2.0]
    assert float(landed[0]["outer/correction_norm"]) > 0 and float(landed[0]["outer/exchange_seconds"]) > 0
    # the spread is measured where rounds start: steps h and 2h, the same step on every replica
    assert [int(r["step"]) for r in rows if r.get("outer/replica_spread")] == [h, 2 * h]


@pytest.mark.slow
def test_a_fit_interrupted_with_a_round_in_flight_stops_cleanly(tmp_path):
    proc = run(tmp_path, expect_failure=True, strategy="noloco", devices=2, max_steps=12, fail_at_step=4,
               strategy_kwargs={"sync_every": 3, "overlap_steps": 2})
    assert "stopping on purpose at step 4" in proc.stderr
    assert "terminate called" not in proc.stderr and "Traceback" in proc.stderr


def _failing_peer(rank: int, port: int, out: str) -> None:
    init_gloo(rank, 2, port=port, timeout_s=20)
    if rank == 1:
        os._exit(0)  # the peer stops before it posts its side of the round
    transport = TorchDistributedTransport(torch.device("cpu"))
    try:
        transport.start_group_sum(torch.ones(1000), (0, 1)).wait()
        message = "no error"
    except PeerError as err:
        message = str(err)
    torch.save({"message": message}, out)
    os._exit(0)


@pytest.mark.slow
def test_a_peer_that_stops_during_a_round_gives_an_error_naming_it(tmp_path):
    out = str(tmp_path / "result.pt")
    start_ranks(_failing_peer, 2, args=(free_port(), out), start_method="spawn", timeout_s=240)
    result = torch.load(out)
    assert "replica(s) [1]" in result["message"] and "global rank(s) [1]" in result["message"]
    assert "Timed out" not in result["message"]  # the closed connection, not the process group's timeout


def _watched_exchange(rank: int, port: int, out: str) -> None:
    init_gloo(rank, 2, port=port, timeout_s=20)
    transport = TorchDistributedTransport(torch.device("cpu"))
    pending = transport.start_group_sum(torch.full((1000,), float(rank)), (0, 1)).watch()
    deadline = time.monotonic() + 60
    while not pending.done() and time.monotonic() < deadline:  # training would go on here
        time.sleep(0.01)
    seen = pending.done(), pending.completed_after()  # nobody has waited for it yet
    total = pending.wait()
    if rank == 0:
        torch.save({"seen": seen, "total": total}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_watched_exchange_reports_its_completion_before_it_is_waited_for(tmp_path):
    # gloo's point-to-point works only report completion once waited for; the watcher thread lets the
    # strategy see, without blocking, that the transfer is done (what "auto" measures).
    out = str(tmp_path / "watched.pt")
    start_ranks(_watched_exchange, 2, args=(free_port(), out), start_method="spawn", timeout_s=240)
    result = torch.load(out)
    done, after = result["seen"]
    assert done and after is not None
    assert torch.equal(result["total"], torch.ones(1000))
