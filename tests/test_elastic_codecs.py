"""Lossy wire formats on the elastic transport, in one process over the scripted membership and in-process
process group of tests/elastic_fakes.py: the elastic rounds encode as the static launch does
(lightning_loco/wire/coded.py), so they match the static maths over the in-process transport, and a
round taken alone or dropped keeps the error-feedback residual true.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_loco.algorithms import DiLoCo, NoLoCo
from lightning_loco.replica.options import WireConfig
from lightning_loco.transport import InProcessNetwork

from elastic_fakes import H, Hub, Runner, Script, elastic_runner, in_threads

IDS = ("a", "b", "c")
SIZE = 40  # values per replica: several int8 blocks of 16, and chunks of DiLoCo's all-reduce that are not exact
WIRES = {
    "bf16": WireConfig("bfloat16", error_feedback=False),
    "int8": WireConfig("int8", block_size=16, error_feedback=False),
    "int8-ef": WireConfig("int8", block_size=16, error_feedback=True),
}


def runs(make, wire, rounds: int = 4):
    """Three elastic replicas over the fakes and three static ones over the in-process transport, same wire."""
    script = [Script(quorum_id=1, switch=0, members=IDS)]
    hub, network = Hub(), InProcessNetwork(len(IDS))
    elastic = [elastic_runner(hub, r, i, script, make(), wire=wire, size=SIZE) for i, r in enumerate(IDS)]
    static = [Runner(i, network.transport(i), algorithm=make(), wire=wire, size=SIZE) for i in range(len(IDS))]
    in_threads(*[lambda r=r: r.run(rounds * H) for r in elastic])
    in_threads(*[lambda r=r: r.run(rounds * H) for r in static])
    return elastic, static


@pytest.mark.parametrize("wire_name", list(WIRES))
@pytest.mark.parametrize("make", [NoLoCo, DiLoCo], ids=["noloco", "diloco"])
def test_lossy_elastic_rounds_match_the_static_launch(make, wire_name):
    wire = WIRES[wire_name]
    elastic, static = runs(make, wire)
    exact, _ = runs(make, None)
    for e, s, f in zip(elastic, static, exact):
        slot_e, slot_s = e.driver.slots[0], s.driver.slots[0]
        assert torch.equal(e.param.detach(), s.param.detach())  # the static launch's maths, bitwise
        assert torch.equal(slot_e.state.anchor, slot_s.state.anchor)
        if wire.error_feedback:
            assert slot_e.residual is not None and torch.equal(slot_e.residual, slot_s.residual)
        else:
            assert slot_e.residual is None and slot_s.residual is None
        assert e.driver.transport.stats.bytes_sent == s.driver.transport.stats.bytes_sent > 0
        assert not any(r["alone"] for r in e.driver.plugin.rounds)
        # the codec was used (not float32), and its error stays small on this problem
        gap = torch.linalg.vector_norm(e.param.detach() - f.param.detach())
        assert 0 < gap < 0.05 * torch.linalg.vector_norm(f.param.detach())
    assert elastic[0].driver.transport.stats.bytes_sent < exact[0].driver.transport.stats.bytes_sent


def test_a_round_alone_applies_the_payload_as_the_codec_delivers_it():
    """With int8 and error feedback, a round whose partner died applies D(Q(x)) of the payload x it would have
    sent and keeps x − D(Q(x)) as the residual, as a round that met its partner would."""
    wire = WIRES["int8-ef"]
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a, b = (elastic_runner(hub, r, i, script, wire=wire, size=SIZE) for i, r in enumerate("ab"))
    in_threads(lambda: a.run(H), lambda: b.run(H))
    hub.kill("b")
    a.run(H - 1)
    a.inner_step()
    slot = a.driver.slots[0]
    state, algorithm = copy.deepcopy(slot.state), a.driver.algorithm
    sent = algorithm.payload(state, slot.flat.gather()) + slot.residual
    delivered = wire.resolve(False).codec.roundtrip(sent)
    expected = algorithm.apply(state, 2 * delivered, 2)
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.driver.after_inner_step(0)
    assert a.driver.plugin.rounds[-1]["alone"]
    assert torch.equal(a.param.detach(), expected)
    assert torch.equal(slot.residual, sent - delivered)


def test_a_dropped_diloco_round_leaves_the_residual_as_it_was():
    """A dropped round applies nothing, so what the codec lost of its payload is not kept either: the next
    round's pseudo-gradient covers both stretches, and the residual stays the one from before."""
    wire = WIRES["int8-ef"]
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a, b = (elastic_runner(hub, r, i, script, DiLoCo(), wire=wire, size=SIZE) for i, r in enumerate("ab"))
    in_threads(lambda: a.run(H), lambda: b.run(H))
    residual = a.driver.slots[0].residual.clone()
    assert torch.linalg.vector_norm(residual) > 0
    hub.kill("b")
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.run(H)
    assert a.driver.plugin.rounds[-1]["dropped"]
    assert torch.equal(a.driver.slots[0].residual, residual)
