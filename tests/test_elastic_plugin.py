"""The elastic plug-in and transport in one process, over a scripted membership (tests/elastic_fakes.py).

The driver, :class:`ElasticPlugin` and :class:`ElasticTransport` are the real ones; only torchft's
Lighthouse and process group are replaced. Replicas run in threads, since elastic rounds block.
"""

from __future__ import annotations

import copy
import csv
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_loco.algorithms import DiLoCo, GASLoC, NoLoCo
from lightning_loco.driver.plugins import DriverPlugin, Landing, Outcome
from lightning_loco.elastic.plugin import ElasticPlugin, checksum, same
from lightning_loco.transport import InProcessNetwork

from elastic_fakes import FakeMembership, H, Hub, Runner, Script, elastic_runner, in_threads


@pytest.mark.parametrize("make", [NoLoCo, DiLoCo], ids=["noloco", "diloco"])
def test_elastic_rounds_equal_the_static_drivers_bitwise(make):
    n, rounds = 3, 4
    ids = ("a", "b", "c")
    script = [Script(quorum_id=1, switch=0, members=ids)]
    hub = Hub()
    elastic = [elastic_runner(hub, r, i, script, make()) for i, r in enumerate(ids)]
    network = InProcessNetwork(n)
    static = [Runner(i, network.transport(i), algorithm=make()) for i in range(n)]
    in_threads(*[lambda r=r: r.run(rounds * H) for r in elastic])
    in_threads(*[lambda r=r: r.run(rounds * H) for r in static])
    for e, s in zip(elastic, static):
        assert torch.equal(e.param.detach(), s.param.detach())
        assert torch.equal(e.driver.slots[0].state.anchor, s.driver.slots[0].state.anchor)
    records = [r.driver.plugin.rounds for r in elastic]
    assert [[x["outer_step"] for x in rec] for rec in records] == [list(range(rounds))] * n
    for t in range(rounds):  # partners agree: each group is the same seen from each of its members
        groups = {ids[i]: tuple(records[i][t]["group"]) for i in range(n)}
        assert all(groups[m] == g for g in groups.values() for m in g)
        assert not any(records[i][t]["alone"] for i in range(n))


def test_a_partner_that_died_leaves_the_round_to_be_taken_alone():
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a, b = elastic_runner(hub, "a", 0, script), elastic_runner(hub, "b", 1, script)
    in_threads(lambda: a.run(H), lambda: b.run(H))  # round 0 together
    hub.kill("b")
    a.run(H - 1)
    a.inner_step()
    slot = a.driver.slots[0]
    alone_state, weights = copy.deepcopy(slot.state), slot.flat.gather()
    expected = a.driver.algorithm.apply(alone_state, a.driver.algorithm.payload(alone_state, weights), 1)
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.driver.after_inner_step(0)  # round 1: b is gone
    assert torch.equal(a.param.detach(), expected)  # the outer step of a group of one
    a.run(H)  # round 2: the membership's group is broken, taken alone without posting
    rounds = a.driver.plugin.rounds
    assert [(r["outer_step"], r["alone"], r["dropped"]) for r in rounds] == [
        (0, False, False), (1, True, False), (2, True, False)]
    membership = a.driver.transport.membership
    assert membership.failures == 1 and not membership.view.ok
    assert [f["peers"] for f in a.driver.transport.failures] == [["b"]]


def test_diloco_drops_a_round_whose_all_reduce_failed():
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a = elastic_runner(hub, "a", 0, script, DiLoCo())
    b = elastic_runner(hub, "b", 1, script, DiLoCo())
    in_threads(lambda: a.run(H), lambda: b.run(H))
    hub.kill("b")
    a.run(H - 1)
    a.inner_step()
    anchor, weights = a.driver.slots[0].state.anchor.clone(), a.param.detach().clone()
    reports = len(a.driver.reports)
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.driver.after_inner_step(0)
    assert torch.equal(a.driver.slots[0].state.anchor, anchor)  # outer state unchanged
    assert torch.equal(a.param.detach(), weights)  # nothing applied to the live weights
    assert len(a.driver.reports) == reports  # a dropped round leaves no report
    assert a.driver.plugin.rounds[-1]["dropped"] and a.driver.plugin.committed == 1
    # the live weights trained on past the anchor: a heal now carries them apart from it
    assert torch.equal(a.driver.plugin.export_state()["weights"][0], weights)


def test_a_heal_that_stops_after_landing_in_place_leaves_a_state_that_is_not_saved(tmp_path):
    """c (GASLoC with the other momentum form) receives a's outer state into its own anchor, then refuses to
    load it: the error stands, c's plug-in says its outer state is torn, and its strategy refuses to save it."""
    from types import SimpleNamespace

    from lightning_loco import GASLoCStrategy
    from lightning_loco.elastic.config import ElasticConfig
    from lightning_loco.elastic.transport import ElasticTransport

    hub = Hub()
    script = [Script(1, 0, ("a",)), Script(2, 1, ("a", "c"), joiners=("c",), donor="a")]
    a = elastic_runner(hub, "a", 0, script, GASLoC())
    errors: list[BaseException] = []

    transport = ElasticTransport(ElasticConfig(lighthouse="127.0.0.1:1", replica_id="c"),
                                 membership=FakeMembership(hub, "c", script))
    plugin = ElasticPlugin(transport)

    def joiner() -> None:
        try:  # the heal runs as c sets up (before its first inner step)
            Runner(1, transport, plugin, GASLoC(momentum_on="sent"))
        except ValueError as err:
            errors.append(err)

    in_threads(lambda: a.run(H), joiner)
    assert "momentum_on='mixed' and cannot resume with momentum_on='sent'" in str(errors[0]), errors
    assert transport.membership.landed >= 1  # its anchor was written before the refusal
    assert "not saved" in plugin.torn
    strategy = GASLoCStrategy()
    strategy.run = SimpleNamespace(driver=SimpleNamespace(plugin=plugin))
    with pytest.raises(RuntimeError, match="partly overwritten by a heal"):
        strategy.save_checkpoint({}, tmp_path / "x.ckpt")
    assert not list(tmp_path.iterdir())  # nothing written
    assert a.driver.plugin.torn is None


@pytest.mark.parametrize("algorithm", [NoLoCo, DiLoCo, GASLoC])
def test_a_joiner_heals_from_its_donor_and_takes_part_from_the_switch(algorithm):
    hub = Hub()
    script = [Script(1, 0, ("a", "b")), Script(2, 2, ("a", "b", "c"), joiners=("c",), donor="a")]
    a, b = elastic_runner(hub, "a", 0, script, algorithm()), elastic_runner(hub, "b", 1, script, algorithm())
    c_box: list[Runner] = []
    # c's before_training waits for a's state, which a sends at the switch before round 2
    in_threads(lambda: a.run(5 * H), lambda: b.run(5 * H),
               lambda: (c_box.append(elastic_runner(hub, "c", 2, script, algorithm())), c_box[0].run(3 * H)))
    (c,) = c_box
    healed, exported = c.driver.plugin.healed_from, a.driver.plugin.exported
    assert [h["donor"] for h in healed] == ["a"] and healed[0]["outer_step"] == 2
    assert healed[0]["checksum"] == exported[0]["checksum"]  # c took a's weights at the switch
    assert exported[0]["weights_sent"] == [False]  # they were a's anchor, bitwise: they travelled once, as it
    landed = c.driver.transport.membership.landed  # into c's own outer state, in place
    assert landed == {NoLoCo: 2, DiLoCo: 1, GASLoC: 1}[algorithm], landed  # an outer optimizer: no momentum yet
    assert c.driver.slots[0].outer_steps == a.driver.slots[0].outer_steps == 5
    assert c.driver.slots[0].inner_steps == a.driver.slots[0].inner_steps == 5 * H
    records = {r: x.driver.plugin.rounds for r, x in zip("abc", (a, b, c))}
    assert [x["outer_step"] for x in records["c"]] == [2, 3, 4]
    for t in (2, 3, 4):
        groups = {r: tuple(rec[t - (2 if r == "c" else 0)]["group"]) for r, rec in records.items()}
        assert all(groups[m] == g for g in groups.values() for m in g)
    assert checksum([c.param.detach()]) != checksum([torch.zeros(3)])


def test_weights_equal_to_the_anchor_are_told_apart_bitwise():
    anchor = torch.tensor([0.0, 1.0, float("nan")])
    assert same(anchor.clone(), anchor)  # a NaN with the same bytes counts as equal
    assert not same(torch.tensor([-0.0, 1.0, float("nan")]), anchor)  # −0.0 == 0.0, but not bitwise
    assert not same(anchor.double(), anchor) and not same(anchor[:2], anchor)


def test_plugin_hooks_run_in_order_around_rounds():
    class Recorder(DriverPlugin):
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def before_training(self) -> None:
            self.calls.append(("before_training",))

        def before_round(self, optimizer_index: int, outer_step: int, schedule) -> None:
            self.calls.append(("before_round", outer_step))

        def after_landing(self, landing: Landing) -> None:
            self.calls.append(("after_landing", landing.outer_step, landing.outcome, landing.final))

        def close(self) -> None:
            self.calls.append(("close",))

    network = InProcessNetwork(1)
    recorder = Recorder()
    runner = Runner(0, network.transport(0), plugin=recorder)
    runner.run(2 * H - 1)
    runner.inner_step()
    runner.driver.after_inner_step(0, last=True)
    runner.driver.close()
    assert recorder.calls == [
        ("before_training",), ("before_round", 0), ("after_landing", 0, Outcome.EXCHANGED, False),
        ("before_round", 1), ("after_landing", 1, Outcome.EXCHANGED, False), ("close",),
    ]


def test_elastic_plugin_needs_an_elastic_transport():
    with pytest.raises(TypeError, match="ElasticTransport"):
        ElasticPlugin(InProcessNetwork(1).transport(0))


# ---------------------------------------------------------------- a Lightning replica heals its whole training state


MAX_STEPS, LIGHTNING_H, HEAL_ROUND = 12, 2, 3


@pytest.fixture
def in_this_process():
    """Trainers of the elastic strategy in this process: each is a world of one, whose default process group
    (and the MASTER_PORT Lightning put in the environment) would outlive the test and clash with the next
    test's processes. Both go when the test ends."""
    import os

    import torch.distributed as dist

    environment = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


class Snapshots(L.Callback):
    """What the replica holds as each step's forward pass ends, before its backward (``on_before_backward``): a
    replica healed at a batch's start shows its healed state there, untouched by that batch's step yet."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict] = {}

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        optimizer = trainer.optimizers[0]
        self.by_step[trainer.global_step] = {
            "lr": [group["lr"] for group in optimizer.param_groups],
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "scheduler": copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "logged_step": trainer.fit_loop.epoch_loop._batches_that_stepped,
            "batch_idx": trainer.fit_loop.epoch_loop.batch_idx,
            "epoch": trainer.current_epoch,
            "inner_steps": trainer.strategy.driver.slots[0].inner_steps,
            "outer_steps": trainer.strategy.outer_steps,
            "batches_seen": pl_module.batches_seen.item(),
            "weights": [p.detach().clone() for p in pl_module.parameters()],
        }

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_) -> None:
        pl_module.batches_seen += 1  # a buffer no optimizer trains (as a BatchNorm's running statistics)


def fit_gpt_replica(hub: Hub, replica_id: str, script, out, heal: bool = True,
                    heal_optimizer: bool = True) -> tuple[L.Trainer, Snapshots]:
    """The shipped GPT (AdamW, warm-up then cosine decay), tiny, as one elastic replica over the scripted membership."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_loco import ElasticConfig, NoLoCoStrategy
    from lightning_loco.elastic.transport import ElasticTransportFactory
    from lightning_loco.examples.gpt import GPT

    torch.manual_seed(0)
    model = GPT(block_size=8, n_layer=1, n_head=2, n_embd=16, lr=1e-2, warmup_steps=4, max_steps=MAX_STEPS)
    model.register_buffer("batches_seen", torch.zeros(()))
    g = torch.Generator().manual_seed(7 if replica_id == "a" else 8)
    tokens = torch.randint(0, 256, (64, 9), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)  # 8 batches: epochs end too
    elastic = ElasticConfig("127.0.0.1:1", replica_id=replica_id, heal=heal, heal_optimizer=heal_optimizer)
    strategy = NoLoCoStrategy(sync_every=LIGHTNING_H, elastic=elastic)
    strategy.transport_factory = ElasticTransportFactory(
        strategy.elastic, membership=lambda: FakeMembership(hub, replica_id, script, heal=heal))
    snapshots = Snapshots()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=MAX_STEPS, log_every_n_steps=1,
        logger=CSVLogger(out, name=replica_id, version=0), enable_progress_bar=False, enable_model_summary=False,
        callbacks=[snapshots, LearningRateMonitor(logging_interval="step"),
                   ModelCheckpoint(dirpath=out / f"{replica_id}-ckpt", every_n_train_steps=4, save_top_k=-1)],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|GPU available|LOCAL_RANK).*")
        trainer.fit(model, train_dataloaders=data)
    return trainer, snapshots


def logged(out, replica_id: str) -> dict[int, float]:
    """step -> the learning rate the replica's logger got at that step."""
    with open(out / replica_id / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    column = next(c for c in rows[0] if c.startswith("lr-"))
    return {int(r["step"]): float(r[column]) for r in rows if r.get(column)}


def test_a_healed_lightning_replica_takes_its_donors_whole_training_state(tmp_path, in_this_process):
    """a trains alone and hands its state to b at outer step 3 (step 6, mid-epoch); then each goes on alone.
    Right after healing, b's step, learning rate, AdamW state, scheduler and loop counters are a's at the same
    step (bitwise); its logged steps and learning rates continue a's, and both end at max_steps with a
    checkpoint named for it."""
    hub = Hub(timeout=60)
    script_a = [Script(1, 0, ("a",)), Script(2, HEAL_ROUND, ("a",), joiners=("b",), donor="a")]
    script_b = [Script(2, HEAL_ROUND, ("b",), joiners=("b",), donor="a")]
    a, seen_a = fit_gpt_replica(hub, "a", script_a, tmp_path)
    b, seen_b = fit_gpt_replica(hub, "b", script_b, tmp_path)  # heals from the state a left in the store

    healed_at = HEAL_ROUND * LIGHTNING_H
    assert min(seen_b.by_step) == healed_at  # b's first step is the run's step 6, not 0
    donor, healed = seen_a.by_step[healed_at], seen_b.by_step[healed_at]
    for key in ("lr", "scheduler", "logged_step", "batch_idx", "epoch", "inner_steps", "outer_steps", "batches_seen"):
        assert healed[key] == donor[key], key
    assert healed["batches_seen"] == healed_at
    state_a, state_b = donor["optimizer"]["state"], healed["optimizer"]["state"]
    assert state_a.keys() == state_b.keys() and state_a
    for index, moments in state_a.items():
        for name, value in moments.items():
            assert torch.equal(value, state_b[index][name]), (index, name)  # AdamW's moments and step, bitwise
    assert donor["optimizer"]["param_groups"] == healed["optimizer"]["param_groups"]

    # the rest of the run: the same steps, learning rates, logged steps and end as a's
    for step in range(healed_at, MAX_STEPS):
        assert seen_b.by_step[step]["lr"] == seen_a.by_step[step]["lr"]
    lr_a, lr_b = logged(tmp_path, "a"), logged(tmp_path, "b")
    assert sorted(lr_b) == list(range(healed_at, MAX_STEPS)) and sorted(lr_a) == list(range(MAX_STEPS))
    assert all(lr_b[s] == lr_a[s] for s in lr_b)
    assert a.global_step == b.global_step == MAX_STEPS
    assert a.strategy.outer_steps == b.strategy.outer_steps == MAX_STEPS // LIGHTNING_H
    saved = {r: sorted(int(p.stem.split("step=")[1]) for p in (tmp_path / f"{r}-ckpt").glob("*.ckpt")) for r in "ab"}
    assert saved == {"a": [4, 8, 12], "b": [8, 12]}  # named by the run's step: b's last is at max_steps too


def test_heal_false_takes_the_step_counts_and_keeps_its_own_optimizer_state(tmp_path, in_this_process):
    """heal=False (a replica resumed from its own checkpoint): b takes a's step, schedule and logged step, so it
    steps, logs and stops with the run, and keeps its own weights and AdamW state (fresh here: empty)."""
    hub = Hub(timeout=60)
    script_a = [Script(1, 0, ("a",)), Script(2, HEAL_ROUND, ("a",), joiners=("b",), donor="a")]
    script_b = [Script(2, HEAL_ROUND, ("b",), joiners=("b",), donor="a")]
    a, seen_a = fit_gpt_replica(hub, "a", script_a, tmp_path)
    b, seen_b = fit_gpt_replica(hub, "b", script_b, tmp_path, heal=False)
    healed_at = HEAL_ROUND * LIGHTNING_H
    donor, healed = seen_a.by_step[healed_at], seen_b.by_step[healed_at]
    for key in ("lr", "scheduler", "logged_step", "inner_steps", "outer_steps"):
        assert healed[key] == donor[key], key
    assert healed["optimizer"]["state"] == {} and donor["optimizer"]["state"]
    assert healed["batches_seen"] == 0 and donor["batches_seen"] == healed_at  # its own module state
    record = b.strategy.outer_step_reports  # b went on alone from there, with its own weights
    assert [r.outer_step for r in record] == list(range(HEAL_ROUND, MAX_STEPS // LIGHTNING_H))
    assert a.global_step == b.global_step == MAX_STEPS


def test_heal_optimizer_false_heals_everything_but_the_inner_optimizers_state(tmp_path, in_this_process):
    """A donor with heal_optimizer=False hands over its weights, outer state, schedule and counters but not
    AdamW's moments: b is at a's step, learning rate and weights right after healing, its AdamW starts afresh
    there (step 1 after its first step, where a's counts on)."""
    hub = Hub(timeout=60)
    script_a = [Script(1, 0, ("a",)), Script(2, HEAL_ROUND, ("a",), joiners=("b",), donor="a")]
    script_b = [Script(2, HEAL_ROUND, ("b",), joiners=("b",), donor="a")]
    a, seen_a = fit_gpt_replica(hub, "a", script_a, tmp_path, heal_optimizer=False)
    b, seen_b = fit_gpt_replica(hub, "b", script_b, tmp_path)
    healed_at = HEAL_ROUND * LIGHTNING_H
    donor, healed = seen_a.by_step[healed_at], seen_b.by_step[healed_at]
    for key in ("lr", "scheduler", "logged_step", "batch_idx", "inner_steps", "outer_steps", "batches_seen"):
        assert healed[key] == donor[key], key
    assert healed["optimizer"]["state"] == {} and donor["optimizer"]["state"]
    assert all(torch.equal(x, y) for x, y in zip(healed["weights"], donor["weights"]))  # a's weights, bitwise
    steps_after = {i: float(m["step"]) for i, m in seen_b.by_step[healed_at + 1]["optimizer"]["state"].items()}
    assert set(steps_after.values()) == {1.0}
    assert {float(m["step"]) for m in seen_a.by_step[healed_at + 1]["optimizer"]["state"].values()} == {healed_at + 1.0}
    assert a.global_step == b.global_step == MAX_STEPS
    from lightning_loco.elastic.healing import taken

    assert "heal_optimizer=False" in taken({"extra": {"optimizers": None}}, True)  # what b's log line says
    assert taken({"extra": {"optimizers": []}}, True) == taken({"extra": None}, True) == "its state"


# ---------------------------------------------------------------- heal keys: one per membership, read once written


class _Member:
    def __init__(self, replica_id: str, step: int, current: bool, store: str) -> None:
        self.replica_id, self.step, self.store_address = replica_id, step, store
        self.data = {"current": current, "view": 3, "ok": True}


class _Quorum:
    def __init__(self, quorum_id: int, members: list) -> None:
        self.quorum_id, self.participants = quorum_id, members


def test_heal_keys_are_new_for_every_membership_and_read_only_once_written():
    """torchft keeps a quorum id while the participants stay the same, so a replica restarted under its id
    before the Lighthouse noticed its death joins a membership with the id it joined at the start. Its heal
    must not read the state written for that first membership: each membership has its own store prefix,
    a joiner waits for its own key, checks whom it was written for, and the last joiner deletes it."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft.process_group import create_store_client

    from lightning_loco.elastic import keys
    from lightning_loco.elastic import state_transfer as heal
    from lightning_loco.elastic.membership import make_plan

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    address = f"127.0.0.1:{store.port}"

    def quorum(step_of_r2: int, step: int) -> _Quorum:  # r2 (re)starting, r0 and r1 at outer step `step`
        return _Quorum(3, [_Member("r0", step, True, address), _Member("r1", step, True, address),
                           _Member("r2", step_of_r2, False, "elsewhere:1")])

    first, second = make_plan(quorum(0, 1), 1, None), make_plan(quorum(0, 16), 1, None)
    assert (first.quorum_id, first.joiners, first.donor) == (second.quorum_id, second.joiners, second.donor)
    assert (first.switch, second.switch) == (2, 17) and first.store_address != second.store_address
    key = keys.heal_key(first.joiners)
    assert key == keys.heal_key(second.joiners)  # the same joiners: only the prefix tells them apart

    def client(plan, timeout: float = 30.0):
        return create_store_client(plan.store_address, timedelta(seconds=timeout))

    def head(plan):
        return heal.header(plan.quorum_id, plan.switch, plan.joiners, plan.donor)

    heal.put(client(first), key, heal.encode({"round": 2}, head(first)))  # the start's heal, never taken
    with pytest.raises(Exception, match="timeout"):
        heal.take(client(second, timeout=0.5), key, 1)  # not the first membership's state: nothing yet
    heal.put(client(second), key, heal.encode({"round": 17}, head(second)))
    state = heal.decode(heal.take(client(second), key, 1), head(second))
    assert state["round"] == 17 and state["donor"] == "r0"
    assert not client(second).check([key])  # its only joiner took it: deleted
    assert client(first).check([key])  # the other membership's key is its own
    with pytest.raises(RuntimeError, match="written for"):  # a state for another membership is never loaded
        heal.decode(heal.take(client(first), key, 1), head(second))
