"""A heal checked against the donor's digests (``verify_heal``, :mod:`lightning_loco.elastic.heal_digests`): the
donor puts the digests of every tensor it exports in the header it writes anyway, and the joiner compares what it
received with them before it assembles the state. An intact heal loads bitwise; a tensor corrupted or changed in
transit is a ``StateMismatchError`` naming the tensor, the donor, the joiner and the membership, with nothing
loaded: on the fake wire of ``elastic_fakes``, through the store (the donor without a process group), through
healing's own calls, and over torchft's real gloo process group and a TCPStore between two spawned processes."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import pytest
import torch
from peers import spawn_pair, torchft_group
from test_elastic_heal import CHUNK, assert_bitwise, mixed_state

from lightning_loco.elastic import healing
from lightning_loco.elastic import state_transfer as heal
from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.heal_digests import check, sign
from lightning_loco.elastic.plan import Plan
from lightning_loco.replica.state_digest import StateMismatchError, digest

from elastic_fakes import FakeGroup, FakeStore, Hub

MEMBERS = ("d", "j")


class FlipsOneBit(FakeGroup):
    """A joiner's group whose message ``message`` arrives with one bit of byte ``byte`` flipped, after its
    receipt: a tensor corrupted in transit."""

    def __init__(self, *args: Any, message: int, byte: int) -> None:
        super().__init__(*args)
        self.message, self.byte = message, byte

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        work = super().recv(tensors, src, tag)
        if tag == heal.TAG_BASE + self.message:
            received = work.finish

            def flipped() -> None:
                received()
                tensors[0][self.byte] ^= 1

            work.finish = flipped
        return work


def heal_over_fakes(outgoing: heal.Outgoing, head: dict[str, Any], group: FakeGroup,
                    into: Optional[dict[int, torch.Tensor]] = None) -> tuple[heal.Incoming, dict[str, Any]]:
    """The joiner ``j`` takes ``outgoing`` from ``d`` over the fake wire: its Incoming and what receive
    returned or raised (under ``"error"``)."""
    hub = group.hub
    store, got = FakeStore(hub, "q4/s8/"), {}
    outgoing.send(FakeGroup(hub, "heal", MEMBERS, "d"), store, "heal/j", [1], 10.0)  # the fake wire keeps it
    incoming = heal.Incoming(heal.take(store, "heal/j", 1), head, "j")
    try:
        got["state"] = incoming.receive(group, 0, 10.0, into)
    except StateMismatchError as err:
        got["error"] = err
    return incoming, got


def test_an_intact_heal_is_checked_and_loads_bitwise() -> None:
    """The header carries one digest pair per tensor (the state's, as digest computes them), and a heal whose
    tensors arrive as sent passes the check and is the donor's state bitwise."""
    head = heal.header(4, 8, ["j"], "d")
    outgoing = heal.prepare(mixed_state(), head, chunk_bytes=CHUNK, verify=True)
    plain = heal.prepare(mixed_state(), head, chunk_bytes=CHUNK)
    assert outgoing.messages == plain.messages and len(outgoing.header) > len(plain.header)
    tensors: list[torch.Tensor] = []
    heal.split(mixed_state(), tensors)
    assert sign(tensors) == [digest(t) for t in tensors]
    hub = Hub()
    incoming, got = heal_over_fakes(outgoing, head, FakeGroup(hub, "heal", MEMBERS, "j"))
    assert incoming.verified and "error" not in got
    state = got["state"]
    assert state.pop("donor") == "d" and state.pop("membership") == head
    assert_bitwise(state, mixed_state())
    # without verify the header has no digests and nothing is checked (the state loads as before)
    incoming, got = heal_over_fakes(plain, head, FakeGroup(Hub(), "heal", MEMBERS, "j"))
    assert not incoming.verified and "error" not in got


@pytest.mark.parametrize("packed", [False, True], ids=["own-message", "packed-message"])
def test_a_bit_flipped_in_transit_is_refused_naming_the_tensor(packed: bool) -> None:
    """One bit of one message flipped on the joiner's side, in a large tensor's own message or in a message
    packing small ones: StateMismatchError naming that tensor's path, the donor, the joiner and the
    membership, and no state (also not with the tensors received in place)."""
    head = heal.header(4, 8, ["j"], "d")
    outgoing = heal.prepare(mixed_state(), head, chunk_bytes=CHUNK, verify=True)
    m = next(i for i, segments in enumerate(outgoing.messages) if (len(segments) > 1) == packed)
    index, start, end = outgoing.messages[m][-1]  # the last tensor of that message
    byte = sum(b - a for _, a, b in outgoing.messages[m]) - (end - start)  # its first byte in the message
    own = mixed_state(seed=1)
    skeleton = heal.Incoming(outgoing.header, head).skeleton
    name = heal.paths(skeleton)[index]
    into = heal.in_place(skeleton, own, heal.Incoming(outgoing.header, head).metas)
    incoming, got = heal_over_fakes(outgoing, head, FlipsOneBit(Hub(), "heal", MEMBERS, "j", message=m, byte=byte),
                                    into)
    assert "state" not in got and incoming.state is None
    message = str(got["error"])
    assert f"tensor {name!r}" in message and "replica 'd'" in message and "Replica 'j'" in message
    assert "membership 4 (from outer step 8)" in message
    assert "corrupted or changed in transit" in message and "not loaded" in message


def test_a_state_changed_while_it_is_sent_is_refused() -> None:
    """The donor's tensors are views of its live state: one changed after the digests were taken (between
    prepare and send) arrives other than digested."""
    head = heal.header(4, 8, ["j"], "d")
    state = mixed_state()
    outgoing = heal.prepare(state, head, chunk_bytes=CHUNK, verify=True)
    state["driver"][0]["state"]["momentum"][17] += 1.0
    incoming, got = heal_over_fakes(outgoing, head, FakeGroup(Hub(), "heal", MEMBERS, "j"))
    assert incoming.state is None
    assert "tensor 'driver.0.state.momentum'" in str(got["error"])


def tampered(state: dict[str, Any], head: dict[str, Any], index: int) -> bytes:
    """The store's header of ``state`` sent whole (as a donor without a process group writes it), its digest of
    tensor ``index`` one off: a state that changed on its way."""
    tensors: list[torch.Tensor] = []
    heal.split(state, tensors)
    signed = sign(tensors)
    signed[index] = (signed[index][0] + 1, signed[index][1])
    return heal.encode(state, head, signed)


def test_through_the_store_the_whole_state_is_checked_too() -> None:
    """A donor without a process group puts the whole state and its digests in the header: an intact one
    loads bitwise; one whose tensor differs from its digest is refused as the header is read."""
    head = heal.header(2, 3, ["j"], "d")
    outgoing = heal.prepare(mixed_state(), head, over_group=False, verify=True)
    incoming = heal.Incoming(outgoing.header, head, "j")
    assert incoming.verified and outgoing.messages == []
    state = incoming.receive(None, 0, 1.0)
    assert state.pop("donor") == "d" and state.pop("membership") == head
    assert_bitwise(state, mixed_state())
    names = heal.paths(heal.split(mixed_state(), []))
    with pytest.raises(StateMismatchError) as refused:
        heal.Incoming(tampered(mixed_state(), head, 5), head, "j")
    message = str(refused.value)
    assert f"tensor {names[5]!r}" in message and "replica 'd'" in message and "Replica 'j'" in message
    assert "membership 2 (from outer step 3)" in message and "not loaded" in message


def test_a_header_that_digests_other_tensors_than_arrived_is_refused() -> None:
    tensors = [torch.ones(3), torch.zeros(2)]
    head = heal.header(1, 2, ["a", "b"], "d")
    check(["x", "y"], tensors, sign(tensors), head)  # agrees: no error
    with pytest.raises(StateMismatchError, match=r"A joiner of \['a', 'b'\] .* digests 1 tensors and 2 arrived"):
        check(["x", "y"], tensors, sign(tensors)[:1], head)


# ---------------------------------------------------------------- through healing's own calls (hand_state / take_state)


def side(replica_id: str, store: FakeStore, lines: list[str]) -> healing.Side:
    config = ElasticConfig("127.0.0.1:1", replica_id=replica_id, outer_step_timeout=10.0, join_timeout=10.0,
                           verify_heal=True)
    return healing.Side(replica_id, config, lambda plan: store, lambda what: None,
                        lambda fmt, *args: lines.append(fmt % args))


def heal_through_healing(group: FakeGroup) -> tuple[list[dict[str, Any]], list[str], Any]:
    """``d`` hands mixed_state() to ``j`` with hand_state (verify_heal=True), ``j`` takes it with take_state over
    ``group``: what ``j`` loaded, its log lines and what take_state returned or raised."""
    hub = group.hub
    store = FakeStore(hub, "q4/")
    plan = Plan(4, MEMBERS, 8, ("j",), "d", reuse=False, store_address="fake")
    loaded: list[dict[str, Any]] = []

    def load(state: dict[str, Any], everything: bool) -> int:
        loaded.append(state)
        return 8

    donor = threading.Thread(target=healing.hand_state, args=(side("d", store, []), plan,
                                                              FakeGroup(hub, "heal", MEMBERS, "d"), mixed_state()))
    donor.start()
    lines: list[str] = []
    try:
        result: Any = healing.take_state(side("j", store, lines), plan, group, load)
    except StateMismatchError as err:
        result = err
    donor.join(30)
    return loaded, lines, result


def test_healing_loads_a_checked_state_and_says_so() -> None:
    loaded, lines, result = heal_through_healing(FakeGroup(Hub(), "heal", MEMBERS, "j"))
    assert result == 8 and len(loaded) == 1
    assert_bitwise({k: v for k, v in loaded[0].items() if k not in ("donor", "membership")}, mixed_state())
    assert "checked against the donor's digests" in lines[-1]


def test_healing_refuses_a_corrupted_state_loads_nothing_and_aborts_the_group() -> None:
    """take_state raises the StateMismatchError itself (not a broken transfer's RuntimeError), never calls
    load, and aborts the membership's group."""
    hub = Hub()
    loaded, lines, result = heal_through_healing(FlipsOneBit(hub, "heal", MEMBERS, "j", message=0, byte=100))
    assert isinstance(result, StateMismatchError) and loaded == [] and lines == []
    assert "Replica 'j' received replica 'd'" in str(result) and "heal" in hub.aborted


# ---------------------------------------------------------------- over torchft's gloo group and a TCPStore


def _peer(rank: int, address: str, changed: bool, conn: Any) -> None:
    """One process: rank 0 hands mixed_state() over the group (verify=True; ``changed``: a tensor changed after
    its digest was taken), then through the store with one digest off; rank 1 takes both and reports what
    each gave (bitwise, or the error's type and message)."""
    try:
        pg, store = torchft_group(address, rank)
        head = heal.header(1, 6, ["r1"], "r0")
        if rank == 0:
            state = mixed_state()
            outgoing = heal.prepare(state, head, chunk_bytes=CHUNK, verify=True)
            if changed:
                state["extra"]["optimizer"]["state"][0]["exp_avg_sq"][2] = 5.0
            outgoing.send(pg, store, "heal/r1", [1], 60.0)
            heal.put(store, "whole/r1", tampered(mixed_state(), head, 0) if changed else
                     heal.prepare(mixed_state(), head, over_group=False, verify=True).header)
            conn.send(("sent", len(outgoing.messages)))
        else:
            results = []
            for key, group in (("heal/r1", pg), ("whole/r1", None)):
                try:
                    incoming = heal.Incoming(heal.take(store, key, 1), head, "r1")
                    state = incoming.receive(group, 0, 60.0)
                except StateMismatchError as err:
                    results.append(("refused", str(err)))
                    continue
                state.pop("donor"), state.pop("membership")
                try:
                    assert_bitwise(state, mixed_state())
                    results.append(("bitwise", incoming.verified))
                except AssertionError as err:
                    results.append(("differs", repr(err)))
            conn.send(("received", results))
    except BaseException as err:  # noqa: BLE001  (reported to the test)
        conn.send(("crashed", repr(err)))
    finally:
        conn.close()
        os._exit(0)


def run_pair(changed: bool) -> tuple[Any, Any]:
    return spawn_pair(_peer, changed)


@pytest.mark.parametrize("changed", [False, True], ids=["intact", "changed"])
def test_over_gloo_and_a_tcp_store_the_heal_is_checked(changed: bool) -> None:
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    donor, joiner = run_pair(changed)
    assert donor[0] == "sent" and donor[1] > 5, donor
    assert joiner[0] == "received", joiner
    over_group, whole = joiner[1]
    if not changed:
        assert over_group == ("bitwise", True) and whole == ("bitwise", True), joiner
        return
    assert over_group[0] == "refused" and whole[0] == "refused", joiner
    for (_, message), name in zip((over_group, whole), ("extra.optimizer.state.0.exp_avg_sq", "driver.0.state.anchor")):
        assert f"tensor {name!r}" in message and "replica 'r0'" in message and "Replica 'r1'" in message, message
        assert "membership 1 (from outer step 6)" in message and "not loaded" in message, message
