"""Healing's transfer (:mod:`lightning_loco.elastic.state_transfer`): a header through the store, the tensors point to
point in bounded messages. In process over the fake wire of ``elastic_fakes`` (several joiners, a donor
that dies mid-transfer), and over torchft's real gloo process group between two spawned processes (not
forked: a child forked from a test process inherits the locks its threads held at that instant, the store's
server thread among them)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from peers import spawn_pair, torchft_group

from lightning_loco.elastic import state_transfer as heal

from elastic_fakes import FakeGroup, FakeStore, Hub

CHUNK = 4096  # bytes: small enough that the states below take several messages of each kind


def mixed_state(seed: int = 0) -> dict[str, Any]:
    """A training state's shapes of things: large and small tensors of several dtypes, a transposed (not
    contiguous) one, a 0-dim step count, an empty one, bits that a float compare would not see (-0.0, NaN),
    and plain values."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(3000, generator=g)
    weights[:2] = torch.tensor([-0.0, float("nan")])
    return {
        "driver": [{"inner_steps": 12, "outer_steps": 6, "state": {"anchor": weights.clone(), "momentum": torch.randn(
            3000, generator=g, dtype=torch.float64)}, "phase": None}],
        "weights": [weights],
        "extra": {"optimizer": {"state": {0: {"step": torch.tensor(12.0),
                                              "exp_avg": torch.randn(40, 30, generator=g).t(),
                                              "exp_avg_sq": torch.rand(7, generator=g).to(torch.bfloat16)}},
                                "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0]}]},
                  "mask": torch.rand(50, generator=g) > 0.5, "ids": torch.randint(0, 9, (33,), generator=g),
                  "empty": torch.zeros(0, 4)},
    }


def assert_bitwise(got: Any, want: Any) -> None:
    """Same structure, same plain values, and tensors of the same dtype, shape and bytes."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in (got, want)]
        assert torch.equal(*raw)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for key in want:
            assert_bitwise(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want):
            assert_bitwise(a, b)
    else:
        assert got == want


def test_cut_bounds_every_message_and_packs_small_tensors() -> None:
    messages = heal.cut([10_000, 100, 0, 300, 9_000, 50], chunk_bytes=4096, small=1000)
    assert messages == [[(0, 0, 4096)], [(0, 4096, 8192)], [(0, 8192, 10_000)], [(4, 0, 4096)], [(4, 4096, 8192)],
                        [(4, 8192, 9_000)], [(1, 0, 100), (3, 0, 300), (5, 0, 50)]]
    assert heal.cut([3000] * 5, chunk_bytes=4096, small=4096) == [[(0, 0, 3000)], [(1, 0, 3000)], [(2, 0, 3000)],
                                                                  [(3, 0, 3000)], [(4, 0, 3000)]]


def test_a_state_crosses_in_messages_bitwise_to_every_joiner() -> None:
    """The donor (rank 0) heals two joiners: the header in the store holds no tensor data, the tensors take
    several messages of at most CHUNK bytes, and each joiner's state is the donor's, bitwise."""
    hub, state = Hub(), mixed_state()
    head = heal.header(4, 8, ["j1", "j2"], "d")
    outgoing = heal.prepare(state, head, chunk_bytes=CHUNK)
    sizes = [sum(b - a for _, a, b in m) for m in outgoing.messages]
    assert len(sizes) > 5 and max(sizes) <= CHUNK and any(len(m) > 1 for m in outgoing.messages)
    tensor_bytes = sum(t.numel() for t in outgoing.tensors)
    assert len(outgoing.header) < tensor_bytes / 4 and outgoing.nbytes == len(outgoing.header) + tensor_bytes
    members = ("d", "j1", "j2")
    store, got = FakeStore(hub, "q4/s8/"), {}

    def joiner(rank: int) -> None:
        incoming = heal.Incoming(heal.take(store, "heal/j1,j2", 2), head)
        assert incoming.messages == outgoing.messages and incoming.nbytes == outgoing.nbytes
        got[rank] = incoming.receive(FakeGroup(hub, "heal", members, members[rank]), 0, 10.0)

    threads = [threading.Thread(target=joiner, args=(r,)) for r in (1, 2)]
    for thread in threads:
        thread.start()
    outgoing.send(FakeGroup(hub, "heal", members, "d"), store, "heal/j1,j2", [1, 2], 10.0)
    for thread in threads:
        thread.join(30)
    assert sorted(got) == [1, 2]
    for rank in (1, 2):
        assert got[rank].pop("donor") == "d" and got[rank].pop("membership") == head
        assert_bitwise(got[rank], mixed_state())
    assert hub.store == {}  # the last joiner deleted the header


def test_a_joiner_receives_in_place_where_its_own_state_matches() -> None:
    """landing() pairs the donor's tensors with the joiner's own by path, dtype and shape (CPU, contiguous,
    not sharing memory with an earlier one); the state received is the donor's bitwise, in the joiner's own
    tensors where they matched and in new ones elsewhere."""
    hub, state, head = Hub(), mixed_state(), heal.header(4, 8, ["j"], "d")
    outgoing = heal.prepare(state, head, chunk_bytes=CHUNK)
    own = mixed_state(seed=1)
    anchor, momentum = own["driver"][0]["state"]["anchor"], own["driver"][0]["state"]["momentum"]
    own["driver"][0]["state"]["momentum"] = momentum.float()  # another dtype: not a landing place
    own["extra"]["optimizer"]["state"][0]["exp_avg"] = torch.zeros(40, 30)  # another shape (the donor's is 30 × 40)
    own["extra"]["mask"] = torch.zeros(50, dtype=torch.bool)
    own["weights"][0] = anchor.view(-1)  # the donor's dtype and shape, but the anchor's memory: not landed too
    own["extra"]["ids"] = torch.zeros(33, dtype=torch.int64)
    incoming = heal.Incoming(outgoing.header, head)
    into = heal.in_place(incoming.skeleton, own, incoming.metas)
    optimizer = own["extra"]["optimizer"]["state"][0]
    assert {t.data_ptr() for t in into.values()} == {t.data_ptr() for t in (
        anchor, own["extra"]["mask"], own["extra"]["ids"], optimizer["step"], optimizer["exp_avg_sq"])}

    got: dict[str, Any] = {}
    store = FakeStore(hub, "q4/s8/")
    thread = threading.Thread(target=lambda: got.update(incoming.receive(
        FakeGroup(hub, "heal", ("d", "j"), "j"), 0, 10.0, into)))
    thread.start()
    outgoing.send(FakeGroup(hub, "heal", ("d", "j"), "d"), store, "heal/j", [1], 10.0)
    thread.join(30)
    assert got.pop("donor") == "d" and got.pop("membership") == head
    assert_bitwise(got, mixed_state())
    assert got["driver"][0]["state"]["anchor"].data_ptr() == anchor.data_ptr()  # received in place
    assert got["extra"]["ids"].data_ptr() == own["extra"]["ids"].data_ptr()
    assert got["driver"][0]["state"]["momentum"].dtype == torch.float64  # received into a new tensor
    assert got["weights"][0].data_ptr() != anchor.data_ptr()  # so were the weights: both arrived whole


def test_a_state_for_another_membership_is_refused_before_any_transfer() -> None:
    outgoing = heal.prepare(mixed_state(), heal.header(2, 3, ["j"], "d"), chunk_bytes=CHUNK)
    with pytest.raises(RuntimeError, match="two memberships shared a store key"):
        heal.Incoming(outgoing.header, heal.header(2, 17, ["j"], "d"))


def test_without_a_group_the_state_comes_whole_through_the_store() -> None:
    """A donor whose rendezvous failed puts the whole state in the header; the joiner needs no group."""
    head = heal.header(2, 3, ["j"], "d")
    outgoing = heal.prepare(mixed_state(), head, over_group=False)
    assert outgoing.messages == [] and outgoing.tensors == []
    incoming = heal.Incoming(outgoing.header, head)
    state = incoming.receive(None, 0, 1.0)
    assert state.pop("donor") == "d" and state.pop("membership") == head
    assert_bitwise(state, mixed_state())
    with pytest.raises(RuntimeError, match="no process group"):
        heal.Incoming(heal.prepare(mixed_state(), head).header, head).receive(None, 0, 1.0)
    # a state larger than one store value cannot come whole: the joiner is told so at once
    big = {"weights": [torch.zeros(heal.STORE_VALUE_MAX // 4 + 1)]}
    outgoing = heal.prepare(big, head, over_group=False)
    assert len(outgoing.header) < 10_000
    with pytest.raises(RuntimeError, match="no process group for this membership .* more than one store value"):
        heal.Incoming(outgoing.header, head)


class DiesAfter(FakeGroup):
    """The donor's group: it dies (its connections close) after posting ``sends`` messages."""

    def __init__(self, *args: Any, sends: int) -> None:
        super().__init__(*args)
        self.sends = sends

    def send(self, tensors, dst, tag):
        if self.sends == 0:
            self.hub.kill(self.me)
            raise RuntimeError("the donor died")
        self.sends -= 1
        return super().send(tensors, dst, tag)


def test_a_donor_that_dies_mid_transfer_is_an_error_on_the_joiner() -> None:
    """The joiner takes the messages that arrived, then fails on the first that never comes, naming it."""
    hub, head = Hub(timeout=30), heal.header(1, 5, ["j"], "d")
    outgoing = heal.prepare(mixed_state(), head, chunk_bytes=CHUNK)
    store, members = FakeStore(hub, "q1/s5/"), ("d", "j")
    with pytest.raises(RuntimeError, match="the donor died"):
        outgoing.send(DiesAfter(hub, "heal", members, "d", sends=3), store, "heal/j", [1], 30.0)
    incoming = heal.Incoming(heal.take(store, "heal/j", 1), head)
    with pytest.raises(RuntimeError) as failed:
        incoming.receive(FakeGroup(hub, "heal", members, "j"), 0, 30.0)
    total = len(outgoing.messages)
    assert f"message 4 of {total} from rank 0 failed" in str(failed.value) and "closed" in str(failed.value)
    assert incoming.state is None


# ---------------------------------------------------------------- over torchft's gloo group, between processes


def _peer(rank: int, address: str, dies_after: int, conn: Any) -> None:
    """One process: rank 0 sends mixed_state() in small messages (dying after ``dies_after`` of them,
    if set), rank 1 receives it and reports whether it is bitwise the state, or the error it got."""
    try:
        pg, store = torchft_group(address, rank)
        head = heal.header(1, 0, ["r1"], "r0")
        if rank == 0:
            outgoing = heal.prepare(mixed_state(), head, chunk_bytes=CHUNK)
            if dies_after:
                outgoing.messages = outgoing.messages[:dies_after]
                outgoing.send(pg, store, "heal/r1", [1], 60.0)
                os._exit(3)  # as SIGKILL would: no goodbye on the connection
            outgoing.send(pg, store, "heal/r1", [1], 60.0)
            conn.send(("sent", len(outgoing.messages)))
        else:
            incoming = heal.Incoming(heal.take(store, "heal/r1", 1), head)
            try:
                state = incoming.receive(pg, 0, 60.0)
            except RuntimeError as err:
                conn.send(("error", str(err)))
            else:
                state.pop("donor"), state.pop("membership")
                try:
                    assert_bitwise(state, mixed_state())
                    conn.send(("bitwise", len(incoming.messages)))
                except AssertionError as err:
                    conn.send(("differs", repr(err)))
    except BaseException as err:  # noqa: BLE001  (reported to the test)
        conn.send(("crashed", repr(err)))
    finally:
        conn.close()
        os._exit(0)


def run_pair(dies_after: int = 0) -> tuple[Any, Any]:
    return spawn_pair(_peer, dies_after)


def test_over_gloo_a_state_crosses_in_several_messages_bitwise() -> None:
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    donor, joiner = run_pair()
    assert donor[0] == "sent" and donor[1] > 5, donor
    assert joiner == ("bitwise", donor[1]), joiner


def test_over_gloo_a_donor_that_dies_mid_transfer_is_an_error_on_the_joiner() -> None:
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    donor, joiner = run_pair(dies_after=3)
    assert donor[0] == "silent", donor  # it died after its third message
    assert joiner[0] == "error" and "from rank 0 failed" in joiner[1], joiner
    assert "message 4 of" in joiner[1] or "message 3 of" in joiner[1], joiner
