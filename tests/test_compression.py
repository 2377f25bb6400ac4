"""Lossy wire formats through the driver, the transports and the strategies.

Most tests run replicas over the in-process transport (no processes): the driver against the
codec-aware ``ReplicaSimulator`` bitwise, the algorithms' identities within the codec's error,
bytes against the size formulas, payload checks, error feedback and exact resume. One test runs
the torch.distributed transport in forked gloo processes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from lightning_loco import DiLoCoStrategy, ElasticConfig, GASLoCStrategy, NoLoCoStrategy
from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.driver.driver import OuterStepReport
from lightning_loco.driver.rounds import post as post_round
from lightning_loco.replica.options import WireConfig
from lightning_loco.testing.launch import free_port, init_gloo, start_ranks
from lightning_loco.trainer.monitoring import OuterStepMonitor
from lightning_loco.transport import InProcessNetwork, TorchDistributedTransport
from lightning_loco.transport.base import FIRST_ROUND, RoundId
from lightning_loco.wire.codecs import (
    PayloadError,
    all_reduce_bytes,
    chunked_all_reduce,
    decode_sum,
    make_codec,
    roundtrip_segments,
    segments,
)
from lightning_loco.wire.sparse import TopKCodec

import tiny
from oracle import ReplicaSimulator
from test_driver import ALGORITHMS, assert_same, lockstep, replicas_for, roundtrip, threaded, trace

WIRES = {
    "bfloat16": WireConfig("bfloat16"),
    "float16": WireConfig("float16"),
    "int8": WireConfig("int8", block_size=4),  # small blocks: several per tiny model
}


def config_for(name: str, error_feedback=None) -> WireConfig:
    return WireConfig(WIRES[name].format, block_size=WIRES[name].block_size, error_feedback=error_feedback)


def wire_for(name: str, algorithm_name: str, error_feedback=None):
    """The wire format as a run of ``algorithm_name`` resolves it (the codec, and error feedback)."""
    algorithm = ALGORITHMS[algorithm_name]()
    return config_for(name, error_feedback).resolve(algorithm.payload_is_pseudo_gradient)


# ---------------------------------------------------------------------------- float32 is today's path


class Recording:
    """A transport that records what the driver hands it, then passes it on."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.replica, self.num_replicas, self.stats = inner.replica, inner.num_replicas, inner.stats

    slices_per_replica = 1

    def start_group_sum(self, payload, group, codec=None, round_id=FIRST_ROUND):
        self.calls.append((payload, codec, round_id))
        return self.inner.start_group_sum(payload, group, codec, round_id)

    def start_all_reduce_sum(self, payload, codec=None, round_id=FIRST_ROUND):
        self.calls.append((payload, codec, round_id))
        return self.inner.start_all_reduce_sum(payload, codec, round_id)

    def resolved(self, total, peers=()):
        return self.inner.resolved(total, peers)


@pytest.mark.parametrize("cls", [NoLoCoStrategy, DiLoCoStrategy, GASLoCStrategy])
def test_float32_hands_the_payload_itself_to_the_transport(cls):
    assert not cls().options.wire.lossy  # the default: the driver gets no wire format at all
    network = InProcessNetwork(2)
    weights = [torch.arange(6.0) + i for i in range(2)]
    posted = []
    for i in range(2):
        algorithm = NoLoCo()
        transport = Recording(network.transport(i))
        state = algorithm.init_state(weights[i], [torch.Size([6])])
        posted.append((post_round(algorithm, state, weights[i], 0, transport, wire=WireConfig().resolve(False)),
                       transport))
    for (p, transport), w in zip(posted, weights):
        payload, codec, round_id = transport.calls[0]
        assert payload is w and codec is None and round_id == RoundId(0)  # the same tensor, no codec, no copy
        assert torch.equal(p.pending.wait(), weights[0] + weights[1])


# ---------------------------------------------------------------------------- the driver against the reference


@pytest.mark.parametrize("wire", ["bfloat16", "int8"])
@pytest.mark.parametrize("name", ["noloco", "noloco_gamma0.9", "diloco", "gasloc_random_pairs", "gasloc_complete"])
def test_rounds_equal_the_codec_reference_bitwise(name, wire):
    """The driver and transport (encode, send, decode every payload, sum in order; the chunked
    all-reduce; residuals) against ReplicaSimulator's separate use of the codec functions."""
    n, H, rounds = 4, 3, 4
    fmt = wire_for(wire, name)
    _, replicas = replicas_for(ALGORITHMS[name], n, H, wire=config_for(wire))
    for r in replicas:
        r.driver.track_norms = True
    threaded(replicas, rounds * H)
    sim = ReplicaSimulator(ALGORITHMS[name](), [replicas[0].initial[0]] * n, replicas[0].flats[0].shapes, wire=fmt)
    for t in range(rounds):
        new = sim.step([r.logs[0].starts[t] for r in replicas])
        for i, r in enumerate(replicas):
            assert_same(r.logs[0].landings[t].anchor, sim.anchors[i], f"anchor of replica {i}, round {t}")
            assert_same(r.logs[0].landings[t].after, new[i], f"weights of replica {i}, round {t}")
            assert r.driver.reports[t].compression_error_norm > 0
    if name == "diloco":  # everyone decodes the same bytes: DiLoCo's replicas stay bitwise identical
        for r in replicas[1:]:
            assert_same(r.flats[0].gather(), replicas[0].flats[0].gather())
    if fmt.error_feedback:
        assert all(r.driver.slots[0].residual.abs().max() > 0 for r in replicas)
    else:
        assert all(r.driver.slots[0].residual is None for r in replicas)


def max_error(x: torch.Tensor, codec, chunks: int = 1) -> float:
    return (roundtrip_segments(x, codec, segments(x.numel(), 1, chunks)) - x).abs().max().item()


@pytest.mark.parametrize("wire", ["bfloat16", "float16", "int8"])
def test_noloco_mean_anchor_follows_heavy_ball_diloco_within_the_codec_error(wire):
    """Groups partition the replicas, so mean φ moves by heavy ball on the mean payload; with a
    codec, on the mean *decoded* payload: each replica's change is off by at most β·max error."""
    n, size = 4, 37
    g = torch.Generator().manual_seed(0)
    start = torch.randn(size, generator=g)
    fmt = wire_for(wire, "noloco")
    coded = ReplicaSimulator(NoLoCo(), [start] * n, wire=fmt)
    for t in range(3):
        weights = [a + 0.05 * torch.randn(size, generator=g) for a in coded.anchors]
        before = torch.stack(coded.anchors).mean(0)
        momentum = torch.stack([s.momentum for s in coded.states]).mean(0)
        coded.step(weights)
        decoded_mean = torch.stack([fmt.codec.roundtrip(w) for w in weights]).mean(0)
        expected = before + 0.5 * momentum + 0.7 * (decoded_mean - before)
        assert torch.allclose(torch.stack(coded.anchors).mean(0), expected, atol=1e-6), t
        # against the float32 heavy ball on the same weights: off by β · the codec's largest error
        plain = before + 0.5 * momentum + 0.7 * (torch.stack(weights).mean(0) - before)
        bound = 0.7 * max(max_error(w, fmt.codec) for w in weights) + 1e-6
        assert (torch.stack(coded.anchors).mean(0) - plain).abs().max() <= bound


@pytest.mark.parametrize("wire", ["bfloat16", "int8"])
def test_gasloc_mean_follows_nesterov_diloco_within_the_codec_error(wire):
    """Every matching is doubly stochastic: mean x = mean z exactly in float32; with a codec each
    member mixes decoded z's, so mean x is off by at most α·|G|·(largest error), and the first outer
    SGD step (lr 1, Nesterov γ) by (1 + γ) times that."""
    n, size, alpha, gamma = 4, 41, 0.25, 0.5
    g = torch.Generator().manual_seed(1)
    start = torch.randn(size, generator=g)
    fmt = wire_for(wire, "gasloc_random_pairs")
    exact = ReplicaSimulator(GASLoC(), [start] * n)
    coded = ReplicaSimulator(GASLoC(), [start] * n, wire=fmt)
    weights = [start + 0.1 * torch.randn(size, generator=g) for _ in range(n)]
    exact.step(weights)
    coded.step(weights)
    z = [torch.lerp(start, w, 0.7) for w in weights]
    bound = (1 + gamma) * alpha * 2 * max(max_error(x, fmt.codec) for x in z) + 1e-6
    diff = torch.stack(coded.anchors).mean(0) - torch.stack(exact.anchors).mean(0)
    assert 0 < diff.abs().max() <= bound


@pytest.mark.parametrize("wire", ["bfloat16", "int8"])
def test_diloco_anchor_follows_float32_within_both_quantisations(wire):
    """The mean pseudo-gradient is off by each replica's chunk error plus the re-encoded sum's error
    over N; outer SGD (lr 0.7, Nesterov 0.9) multiplies it by 0.7·1.9 in its first step."""
    n, size = 4, 103
    g = torch.Generator().manual_seed(2)
    start = torch.randn(size, generator=g)
    fmt = wire_for(wire, "diloco")
    exact, coded = ReplicaSimulator(DiLoCo(), [start] * n), ReplicaSimulator(DiLoCo(), [start] * n, wire=fmt)
    weights = [start + 0.1 * torch.randn(size, generator=g) for _ in range(n)]
    exact.step(weights)
    coded.step(weights)
    deltas = [w - start for w in weights]
    first = max(max_error(d, fmt.codec, n) for d in deltas)
    decoded_sum = sum(roundtrip_segments(d, fmt.codec, segments(size, 1, n)) for d in deltas)
    second = max_error(decoded_sum, fmt.codec, n)
    bound = 0.7 * 1.9 * (first + second / n) * (1 + 1e-4) + 1e-6
    diff = (coded.anchors[0] - exact.anchors[0]).abs().max().item()
    assert 0 < diff <= bound
    assert all(torch.equal(a, coded.anchors[0]) for a in coded.anchors)


def test_error_feedback_keeps_the_sum_of_what_was_sent_within_one_step_of_the_truth():
    """Q(Δ + e), e ← Δ + e − D(Q(Δ + e)): what travelled over T rounds adds up to ΣΔ − e_T, whatever
    T. Without it a constant payload loses the same rounding every round, T times over."""
    codec = make_codec("int8", 8)
    g = torch.Generator().manual_seed(3)
    delta = torch.randn(64, generator=g) * torch.logspace(-3, 0, 64)
    rounds = 20
    for feedback in (True, False):
        network = InProcessNetwork(2)
        algorithm = NoLoCo()
        residuals = [torch.zeros(64) if feedback else None for _ in range(2)]
        states = [algorithm.init_state(torch.zeros(64), [torch.Size([64])]) for _ in range(2)]
        sent = torch.zeros(64)
        for t in range(rounds):
            posted = [post_round(algorithm, states[i], delta.clone(), t, network.transport(i),
                                 wire=WireConfig("int8", block_size=8).resolve(False), residual=residuals[i])
                      for i in range(2)]
            sent += codec.roundtrip(posted[0].payload)  # what replica 0's peer decoded from it (as sent)
            for p in posted:
                p.pending.wait()
        error = (sent - rounds * delta).abs().max().item()
        one_round = max_error(delta, codec)
        if feedback:
            assert torch.allclose(sent, rounds * delta - residuals[0], atol=1e-5)
            assert error <= one_round * (1 + 1e-4) + 1e-5
        else:
            assert error == pytest.approx(rounds * one_round, rel=1e-4)


def test_a_decayed_residual_sends_the_payload_plus_beta_times_the_residual_and_keeps_what_it_lost():
    """SparseLoCo's accumulator: Q(Δ + β·e), e ← Δ + β·e − D(Q(Δ + β·e)), round by round; β = 1 is plain error
    feedback, bitwise (the sum Δ + e, no multiplication)."""
    g = torch.Generator().manual_seed(5)
    delta = torch.randn(8192, generator=g)
    for beta in (0.95, 1.0):
        wire = WireConfig("topk", density=0.02, error_feedback_decay=beta).resolve(True)
        assert wire.decay == beta and wire.error_feedback
        network = InProcessNetwork(2)
        algorithm = NoLoCo()  # a payload of weights: Δ is what is sent, whatever the algorithm
        residuals = [torch.zeros(8192) for _ in range(2)]
        states = [algorithm.init_state(torch.zeros(8192), [torch.Size([8192])]) for _ in range(2)]
        for t in range(4):
            before = residuals[0].clone()
            posted = [post_round(algorithm, states[i], delta.clone(), t, network.transport(i), wire=wire,
                                 residual=residuals[i]) for i in range(2)]
            sent = wire.codec.roundtrip(posted[0].payload)
            expected = torch.add(delta, before, alpha=beta) if beta != 1.0 else delta + before
            assert torch.equal(posted[0].payload, expected)
            assert torch.equal(residuals[0], expected - sent)
            assert (sent != 0).sum() < 0.05 * 8192  # top-k: a few values of each chunk travel
            for p in posted:
                p.pending.wait()


def test_a_decay_is_refused_where_no_residual_is_kept_and_outside_its_range():
    with pytest.raises(ValueError, match=r"error_feedback_decay must be a number in \(0, 1\]"):
        WireConfig("topk", error_feedback_decay=1.5).check()
    with pytest.raises(ValueError, match="decay-needs-error-feedback|keeps none"):
        NoLoCoStrategy(wire=WireConfig("int8", error_feedback_decay=0.9))
    DiLoCoStrategy(wire=WireConfig("topk", error_feedback_decay=0.95), outer_momentum=0.0, outer_lr=1.0)


def test_topk_defaults_to_sparselocos_form_and_refuses_it_with_an_outer_momentum():
    with pytest.raises(ValueError, match="topk_mean='senders'.*format='topk'"):
        DiLoCoStrategy(wire=WireConfig("int8", topk_mean="senders"))
    sparseloco = DiLoCoStrategy(wire="topk", outer_lr=1.0, outer_momentum=0.0).options.wire_format
    assert isinstance(sparseloco.codec, TopKCodec) and sparseloco.codec.mean == "senders" and sparseloco.decay == 0.95
    with pytest.raises(ValueError, match="with outer_momentum=0.9 as well"):
        DiLoCoStrategy(wire="topk")  # DiLoCo's Nesterov 0.9 with the senders' mean: diverged in B5
    kept = DiLoCoStrategy(wire=WireConfig("topk", topk_mean="replicas")).options.wire_format  # the momentum kept
    assert isinstance(kept.codec, TopKCodec) and kept.codec.mean == "replicas" and kept.decay == 0.95
    assert DiLoCoStrategy(wire="int8").options.wire_format.decay == 1.0  # plain error feedback elsewhere


# ---------------------------------------------------------------------------- bytes on the wire


@pytest.mark.parametrize("name", ["noloco", "diloco", "gasloc_random_pairs"])
def test_bytes_counted_are_the_codecs_sizes(name):
    n, H, rounds = 4, 2, 2
    sizes = {}
    for wire in ("float32", "bfloat16", "int8"):
        fmt = None if wire == "float32" else wire_for(wire, name)
        _, replicas = replicas_for(ALGORITHMS[name], n, H, wire="float32" if fmt is None else config_for(wire))
        threaded(replicas, rounds * H)
        numel = replicas[0].flats[0].numel
        codec = make_codec() if fmt is None else fmt.codec
        for i, r in enumerate(replicas):
            for report in r.driver.reports:
                if name == "diloco":
                    expected = 2 * (n - 1) * 4 * numel // n if fmt is None else all_reduce_bytes(codec, numel, n, i)
                else:
                    expected = codec.nbytes(numel) * len(report.peers)
                assert report.bytes_sent == report.bytes_received == expected
            assert r.driver.transport.stats.bytes_sent == sum(x.bytes_sent for x in r.driver.reports)
        sizes[wire] = sum(x.bytes_sent for r in replicas for x in r.driver.reports)
    if name == "diloco":  # chunks of 1-2 values: the rounding of 2(N−1)/N is visible, not the ratio
        assert sizes["bfloat16"] < sizes["float32"]
    else:
        assert sizes["bfloat16"] * 2 == sizes["float32"]  # exactly half
        numel = 7
        assert sizes["int8"] * 4 * numel == sizes["float32"] * (numel + 4 * 2)  # 7 values in blocks of 4


# ---------------------------------------------------------------------------- NaN and inf


@pytest.mark.parametrize("wire", [None, "int8"])
def test_a_nan_payload_raises_naming_the_replica_and_nothing_is_sent(wire):
    n, H = 4, 2
    network, replicas = replicas_for(ALGORITHMS["noloco"], n, H, wire=config_for(wire) if wire else "float32",
                                     overlap_steps=1)
    lockstep(replicas, H - 1)
    with torch.no_grad():
        replicas[2].flats[0].params[0][1] = float("nan")
    for r in replicas[:2]:
        r.step()
    posted_before = list(network.posts)
    with pytest.raises(PayloadError, match=r"Replica 2, optimizer 0, outer step 0: .*1 NaN or infinite value"):
        replicas[2].driver.after_inner_step(0)
    assert network.posts == posted_before  # replica 2 posted nothing
    assert all(replica != 2 for replica, _ in network.posts)


# ---------------------------------------------------------------------------- resume with a residual in flight


def residual_of(replica) -> torch.Tensor:
    residual = replica.driver.slots[0].residual  # made at the first round
    return torch.zeros(0) if residual is None else residual.clone()


@pytest.mark.parametrize("name,wire", [("diloco", "int8"), ("noloco", "bfloat16"), ("gasloc_random_pairs", "int8")])
def test_resuming_with_a_residual_and_a_round_in_flight_continues_bitwise(name, wire):
    n, H, tau = 4, 4, 2
    total, cut = 4 * H + tau, 2 * H + 1  # between round 1's start and its landing
    kwargs = {"overlap_steps": tau, "wire": config_for(wire, error_feedback=True)}
    _, whole = replicas_for(ALGORITHMS[name], n, H, **kwargs)
    expected = []
    for _ in range(total):
        lockstep(whole, 1)
        expected.append(trace(whole) + [residual_of(r) for r in whole])
    _, first = replicas_for(ALGORITHMS[name], n, H, **kwargs)
    lockstep(first, cut)
    saved = [roundtrip(r.driver.state_dict()) for r in first]
    assert all(s[0]["in_flight"] is not None and s[0]["residual"].abs().max() > 0 for s in saved)
    weights = [r.flats[0].gather() for r in first]
    _, resumed = replicas_for(ALGORITHMS[name], n, H, weights=[[w] for w in weights], **kwargs)
    for r, s in zip(resumed, saved):
        r.driver.load_state_dict(s)
    for step in range(cut, total):
        lockstep(resumed, 1)
        got = trace(resumed)
        for i, (w, a) in enumerate(got):
            assert_same(w, expected[step][i][0], f"weights of replica {i} after step {step + 1}")
            assert_same(a, expected[step][i][1], f"anchor of replica {i} after step {step + 1}")
            assert_same(residual_of(resumed[i]), expected[step][n + i], f"residual of replica {i}")


# ---------------------------------------------------------------------------- strategies and monitoring


@pytest.mark.parametrize("cls", [NoLoCoStrategy, DiLoCoStrategy, GASLoCStrategy])
@pytest.mark.parametrize(
    "wire,match",
    [
        ("bf16", "wire format must be one of 'float32', 'bfloat16', 'float16', 'int8', 'int4', 'int2', 'topk', "
                 "got 'bf16'"),
        ("int3", "wire format must be one of"),
        (lambda: WireConfig("topk", density=0), "wire density must be a number in \\(0, 1\\], got 0"),
        (lambda: WireConfig("topk", density=1.5), "wire density must be a number in \\(0, 1\\], got 1.5"),
        (lambda: WireConfig("topk", value_format="int3"), "wire value_format must be one of 'int8', 'int4'"),
        (lambda: WireConfig("topk", topk_mean="median"), "wire topk_mean must be one of 'replicas', 'senders'"),
        (3, "wire must be a format name"),
        (lambda: WireConfig("int8", block_size=0), "wire block_size must be an integer >= 1, got 0"),
        (lambda: WireConfig("int8", block_size=64.0), "wire block_size .* got 64.0"),
        (lambda: WireConfig("int8", error_feedback=1), "wire error_feedback must be True or False"),
        (lambda: WireConfig(streams=0), "wire streams must be an integer >= 1, got 0"),
        (lambda: WireConfig(streams=2.0), "wire streams must be an integer >= 1, got 2.0"),
    ],
)
def test_strategies_refuse_bad_wire_arguments_when_built(cls, wire, match):
    with pytest.raises(ValueError, match=match):
        cls(wire=wire() if callable(wire) else wire)


def test_elastic_replicas_take_lossy_wire_formats():
    """Elastic replicas encode as the static launch does (tests/test_elastic_codecs.py checks the maths)."""
    strategy = NoLoCoStrategy(elastic=ElasticConfig("127.0.0.1:29510"), wire="bfloat16")
    assert strategy.elastic is not None and strategy.options.wire_format.codec.name == "bfloat16"
    assert DiLoCoStrategy(elastic=ElasticConfig("127.0.0.1:29510"), wire="int8").options.wire_format.error_feedback


def test_strategies_build_the_wire_format():
    assert DiLoCoStrategy(wire="int8").options.wire_format.error_feedback  # a pseudo-gradient: on by default
    noloco = NoLoCoStrategy(wire="float16").options.wire_format
    assert noloco.codec.name == "float16" and not noloco.error_feedback  # weights: off
    gasloc = GASLoCStrategy(wire=WireConfig("int8", block_size=64, error_feedback=True)).options.wire_format
    assert gasloc.codec.block_size == 64 and gasloc.error_feedback


def test_the_cli_lists_the_wire_arguments_and_reports_bad_ones(monkeypatch, capsys):
    import sys
    from pathlib import Path

    from lightning_loco.cli import main

    config = str(Path(__file__).parent.parent / "examples" / "shakespeare" / "noloco.yaml")
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # as tests/test_cli.py's in_process fixture
    monkeypatch.setattr(sys, "argv", ["lightning-loco"])
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", config, "--trainer.strategy.init_args.wire=bfloat16", "--print_config"])
    assert exit_.value.code == 0
    assert "wire: bfloat16" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", config, "--trainer.strategy.init_args.wire.format=int8",
              "--trainer.strategy.init_args.wire.error_feedback=true", "--print_config"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    for line in ("format: int8", "block_size: null", "error_feedback: true"):
        assert line in printed
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", config, "--trainer.strategy.init_args.wire.format=int8",
              "--trainer.strategy.init_args.wire.block_size=0"])
    assert exit_.value.code == 2
    assert "ValueError: wire block_size must be an integer >= 1, got 0." in capsys.readouterr().err


def test_the_monitor_logs_the_compression_error():
    report = OuterStepReport(0, 3, 40, (1,), 100, 100, 0.1, 0.2, compression_error_norm=0.25)
    assert OuterStepMonitor._metrics(report, 1)["outer/compression_error_norm"] == 0.25
    plain = OuterStepReport(0, 3, 40, (1,), 100, 100, 0.1, 0.2)
    assert "outer/compression_error_norm" not in OuterStepMonitor._metrics(plain, 1)


# ---------------------------------------------------------------------------- torch.distributed, forked gloo


def _payload(replica: int, size: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(10 + replica))


def _gloo_worker(rank: int, world: int, k: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port=port, timeout_s=30)
    try:
        groups = {}
        if k > 1:
            replica_groups = [dist.new_group(list(range(i * k, i * k + k))) for i in range(world // k)]
            slice_groups = [dist.new_group(list(range(j, world, k))) for j in range(k)]
            groups = {"replica_group": replica_groups[rank // k], "slice_group": slice_groups[rank % k]}
        t = TorchDistributedTransport(torch.device("cpu"), ranks_per_replica=k, **groups)
        results = {}
        for name in ("bfloat16", "int8"):
            codec = make_codec(name, 5)
            x = _payload(t.replica, 103)
            group = (0, 1) if t.replica in (0, 1) else tuple(range(2, t.num_replicas))
            results[name] = {
                "group": t.group_sum(x, group, codec=codec) if len(group) else None,
                "all": t.all_reduce_sum(x.clone(), codec=codec),
                "sent": t.stats.bytes_sent,
            }
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("k", [1, 2])
def test_gloo_sums_with_codecs_equal_the_reference_bitwise(tmp_path, k):
    """4 processes: 4 replicas of one rank, or 2 replicas of two ranks (each rank moves one slice)."""
    world = 4
    start_ranks(_gloo_worker, world, args=(world, k, free_port(), str(tmp_path)), start_method="fork", timeout_s=240)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    replicas = world // k
    xs = [_payload(i, 103) for i in range(replicas)]
    for name in ("bfloat16", "int8"):
        codec = make_codec(name, 5)
        # group sums: every member decodes every payload (its own too), sums in order, per slice
        pair_sum = torch.cat([decode_sum({j: codec.encode(xs[j][a:b]) for j in (0, 1)}, b - a, codec, (0, 1))
                              for a, b in segments(103, k, 1)])
        # the all-reduce: chunked per slice, as each rank of a replica moves its own slice
        reduced = torch.cat([chunked_all_reduce([x[a:b] for x in xs], codec) for a, b in segments(103, k, 1)])
        for rank in range(world):
            replica = rank // k
            if replica in (0, 1):
                assert torch.equal(res[rank][name]["group"], pair_sum), (name, rank)
            assert torch.equal(res[rank][name]["all"], reduced), (name, rank)
        assert (reduced - sum(xs)).abs().max() < 0.1


@pytest.mark.slow
def test_diloco_strategy_with_int8_over_two_processes(tmp_path):
    """Lightning end to end: the strategy's arguments reach the transport; no all-reduce is called,
    the replicas are bitwise identical after every outer step, and the bytes are the codec's."""
    h, steps = 4, 8
    recs = tiny.launch(tmp_path, strategy="diloco", devices=2, max_steps=steps,
                       strategy_kwargs={"sync_every": h, "wire": {"format": "int8", "block_size": 16}})
    numel = recs[0]["weights"][0].numel()
    codec = make_codec("int8", 16)
    for step in range(steps):
        same = all(torch.equal(recs[0]["weights"][step], rec["weights"][step]) for rec in recs[1:])
        assert same == ((step + 1) % h == 0), step
    for rec in recs:
        assert [r["bytes_sent"] for r in rec["reports"]] == [all_reduce_bytes(codec, numel, 2, rec["rank"])] * 2
        assert all(r["compression_error_norm"] > 0 for r in rec["reports"])  # error feedback knows it
        for i in (h - 1, 2 * h - 1):
            names = [call[0] for call in rec["calls"][i]]
            assert "all_reduce" not in names and names.count("batch_isend_irecv") == 2, names
