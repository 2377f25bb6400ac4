"""Elastic replicas (torchft membership): argument checks, the plan every member derives alike, and real
runs of separate replica processes over a Lighthouse process on a free port, with replicas killed
(SIGKILL) in the inner phase and in the middle of an exchange, and a replica restarted.

The multi-process runs are ``examples/elastic/replica.py`` subprocesses (each its own Trainer), each in its
own session with a time limit; a failing test kills their process groups.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lightning_loco import DiLoCoStrategy, ElasticConfig, GASLoCStrategy, NoLoCoStrategy
from lightning_loco.testing.elastic import Lighthouse, Replicas, child_env

torchft = pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")

ROOT = Path(__file__).resolve().parents[1]
REPLICA = ROOT / "examples" / "elastic" / "replica.py"


# ---------------------------------------------------------------- arguments, checked when the strategy is built


def elastic(lighthouse: str = "h:1", **fields: Any) -> ElasticConfig:
    return ElasticConfig(lighthouse, **fields)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(elastic=elastic("nohost")), ["lighthouse='nohost'", "HOST:PORT"]),
        (dict(elastic=elastic("h:99999")), ["lighthouse='h:99999'"]),
        (dict(elastic=elastic(outer_step_timeout=0)), ["outer_step_timeout", "default 120"]),
        (dict(elastic=elastic(join_timeout=-1)), ["join_timeout", "default 600"]),
        (dict(elastic=elastic(membership_every=0)), ["membership_every", "default 1"]),
        (dict(elastic=elastic(replica_id="")), ["replica_id=''"]),
        (dict(elastic=elastic(), overlap_steps=1), ["overlap_steps=1", "overlap_steps=0"]),
        (dict(elastic=elastic(), transport_factory=print), ["transport_factory and elastic replicas"]),
        (dict(elastic=elastic(heal_optimizer="no")), ["heal_optimizer must be True or False", "'no'"]),
        (dict(elastic=elastic(heal=1)), ["heal must be True or False"]),
        (dict(elastic=elastic(verify_heal="yes")), ["verify_heal must be True or False", "'yes'", "default False"]),
        (dict(elastic=elastic(), average_at_end=True), ["average_at_end=True with elastic replicas"]),
    ],
)
def test_bad_elastic_arguments_fail_when_built(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        NoLoCoStrategy(sync_every=4, **kwargs)
    for word in words:
        assert word in str(err.value)


def test_elastic_refuses_exponential_gossip() -> None:
    assert DiLoCoStrategy(elastic=elastic()).elastic is not None
    with pytest.raises(ValueError, match="topology='exponential'"):
        GASLoCStrategy(elastic=elastic(), topology="exponential")


def test_an_elastic_replica_is_one_process() -> None:
    import lightning as L

    with pytest.raises(ValueError, match="devices=1 and num_nodes=1"):
        L.Trainer(strategy=NoLoCoStrategy(elastic=elastic("127.0.0.1:1")), accelerator="cpu", devices=2, logger=False)


def test_an_elastic_replica_of_several_ranks_is_one_trainer_of_that_many_processes() -> None:
    import lightning as L

    assert NoLoCoStrategy(elastic=elastic(), ranks_per_replica=2).elastic is not None
    assert DiLoCoStrategy(elastic=elastic(), ranks_per_replica=2).elastic is not None
    sharded = NoLoCoStrategy(elastic=elastic(), ranks_per_replica=2, replica_sharding="fsdp")
    assert sharded.options.replica_sharding is not None
    with pytest.raises(ValueError, match="ranks_per_replica=2 process.*but it has 4 processes"):
        L.Trainer(strategy=NoLoCoStrategy(elastic=elastic("127.0.0.1:1"), ranks_per_replica=2), accelerator="cpu",
                  devices=4, logger=False)
    with pytest.raises(ValueError, match="ranks_per_replica=2 with elastic replicas and a lossy wire format"):
        DiLoCoStrategy(elastic=elastic(), ranks_per_replica=2, wire="int8")
    assert NoLoCoStrategy(elastic=elastic(), ranks_per_replica=2, wire="bfloat16").elastic is not None


def test_an_error_on_a_replica_of_several_ranks_says_the_replica_leaves_as_a_whole() -> None:
    """A rank whose sibling died fails in DDP's all-reduce with gloo's words; the strategy adds what it means."""
    err = RuntimeError("Connection closed by peer [127.0.0.1]:6047")
    NoLoCoStrategy(elastic=elastic(replica_id="B"), ranks_per_replica=2).on_exception(err)
    assert str(err).startswith("Connection closed by peer [127.0.0.1]:6047 Replica 'B' (rank 0 of 2) stops: the "
                               "replica leaves the membership as a whole"), str(err)
    assert "Restart all 2 of its processes" in str(err)
    one = RuntimeError("Connection closed by peer")
    NoLoCoStrategy(elastic=elastic(replica_id="B")).on_exception(one)  # a replica of one process: unchanged
    assert str(one) == "Connection closed by peer"


def test_static_launch_stays_the_default() -> None:
    strategy = NoLoCoStrategy(sync_every=4)
    assert strategy.elastic is None and strategy.options.averages_at_end
    built = NoLoCoStrategy(sync_every=4, elastic=elastic("127.0.0.1:1", replica_id="a", membership_every=3))
    config = built.elastic
    assert (config.url, config.replica_id, config.membership_every) == ("http://127.0.0.1:1", "a", 3)
    assert not built.options.averages_at_end  # elastic replicas keep their own weights at the end


@pytest.mark.slow
def test_without_torchft_the_error_names_the_extra() -> None:
    # A fresh interpreter where importing torchft fails: the package imports, elastic arguments name the extra.
    code = (
        "import sys; sys.modules['torchft'] = None\n"
        "import lightning_loco\n"
        "from lightning_loco import NoLoCoStrategy\n"
        "NoLoCoStrategy(sync_every=4)\n"
        "try:\n"
        "    NoLoCoStrategy(sync_every=4, elastic=lightning_loco.ElasticConfig('127.0.0.1:1'))\n"
        "except ImportError as err:\n"
        "    print('ERR', err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERR" in proc.stdout and "lightning-loco[elastic]" in proc.stdout


@pytest.mark.parametrize("algorithm", ["noloco", "gasloc"])
def test_a_round_finished_alone_is_the_outer_step_of_a_group_of_one(algorithm: str) -> None:
    """What a replica does when its partner fails: ``wait()`` gives ``group_size × own payload``, which the
    algorithm turns into the outer step of a group of one (its own weights and pseudo-gradient)."""
    import torch

    from lightning_loco.algorithms import ALGORITHMS
    from lightning_loco.elastic.transport import ElasticPending

    make = ALGORITHMS[algorithm]
    g = torch.Generator().manual_seed(0)
    start, trained = torch.randn(10, generator=g), torch.randn(10, generator=g)
    shapes = [torch.Size([10])]
    for group_size in (2, 3):
        alone, solo = make(), make()
        state_alone, state_solo = alone.init_state(start, shapes), solo.init_state(start, shapes)
        payload = alone.payload(state_alone, trained)
        pending = ElasticPending(None, [], payload, payload.clone, group_size, 0, (1,), alone=True)
        got = alone.apply(state_alone, pending.wait(), group_size)
        want = solo.apply(state_solo, solo.payload(state_solo, trained).clone(), 1)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(state_alone.anchor, state_solo.anchor)


@pytest.mark.slow
def test_lighthouse_command_prints_its_address_and_serves(capsys: pytest.CaptureFixture) -> None:
    from torchft.coordination import LighthouseClient

    from lightning_loco.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["lighthouse", "--min-replicas", "0"])
    assert exited.value.code == 2 and "min_replicas must be an integer >= 1, got 0" in capsys.readouterr().err
    cli = [sys.executable, "-m", "lightning_loco.cli", "lighthouse"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([*cli, "--min-replicas", "2", "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    try:
        line = proc.stdout.readline()  # the process's own time limit is the test's: killed below on failure
        assert line.startswith("lighthouse 127.0.0.1:") and "(min_replicas=2)" in line, line
        address = line.split()[1]
        LighthouseClient(f"http://{address}", connect_timeout=timedelta(seconds=10)).heartbeat("probe")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------- the plan: derived alike by every participant


@dataclass
class Member:
    replica_id: str
    step: int
    data: Optional[dict[str, Any]]
    store_address: str = "h:1"


@dataclass
class Quorum:
    quorum_id: int
    participants: list[Member]


def test_plan_for_a_fresh_start_a_joiner_and_a_replica_that_fell_behind() -> None:
    from lightning_loco.elastic.membership import View, make_plan

    fresh = Quorum(1, [Member(r, 0, {"current": False}) for r in ("b", "a", "c")])
    plan = make_plan(fresh, every=2, previous=None)
    assert (plan.members, plan.switch, plan.joiners, plan.donor, plan.reuse) == (("a", "b", "c"), 0, (), None, False)

    previous = View(quorum_id=1, members=("a", "b", "c"), rank=0, first_round=0, pg=object())
    same = Quorum(1, [Member(r, 6, {"current": True, "view": 1, "ok": True}) for r in ("a", "b", "c")])
    plan = make_plan(same, every=2, previous=previous)
    assert (plan.switch, plan.joiners, plan.reuse) == (8, (), True)  # nothing changed: keep the group

    failed = Quorum(1, [Member(r, 6, {"current": True, "view": 1, "ok": r != "b"}) for r in ("a", "b", "c")])
    assert not make_plan(failed, every=2, previous=previous).reuse  # a member saw an exchange fail: new group

    joined = Quorum(2, [Member("a", 6, {"current": True, "view": 1, "ok": True}),
                        Member("d", 0, {"current": False, "view": -1}),
                        Member("c", 4, {"current": True, "view": 1, "ok": True})])
    plan = make_plan(joined, every=2, previous=previous)
    # d is starting and c fell behind (it missed a membership): both heal from a at outer step 8
    assert (plan.members, plan.switch, plan.joiners) == (("a", "c", "d"), 8, ("c", "d"))
    assert (plan.donor, plan.reuse) == ("a", False)
    assert plan.store_address.startswith("h:1/") and "q2" in plan.store_address



def test_plan_for_diloco_heals_members_that_committed_fewer_rounds() -> None:
    from lightning_loco.elastic.membership import View, make_plan

    previous = View(quorum_id=3, members=("a", "b", "c"), rank=0, first_round=4, pg=object())
    quorum = Quorum(4, [Member("a", 6, {"current": True, "view": 3, "ok": False, "committed": 1}),
                        Member("b", 6, {"current": True, "view": 3, "ok": False, "committed": 2}),
                        Member("c", 6, {"current": True, "view": 3, "ok": False, "committed": 2})])
    plan = make_plan(quorum, every=1, previous=previous, sync=True)
    # asked at the switch: applies at once; a's all-reduce failed where b's and c's completed: a heals from b
    assert (plan.switch, plan.joiners, plan.behind, plan.donor) == (6, ("a",), ("a",), "b")
    fresh = Quorum(1, [Member(r, 0, {"current": False}) for r in ("b", "a")])
    plan = make_plan(fresh, every=1, previous=None, sync=True)
    assert (plan.switch, plan.joiners, plan.donor) == (0, ("b",), "a")  # DiLoCo starts from one anchor

# ---------------------------------------------------------------- real replicas, a real Lighthouse, SIGKILL

OUTER_STEP_TIMEOUT = 30.0  # an exchange never waits longer: the process groups' timeout
MAX_STEPS = 90  # of the kill-and-rejoin run
RUN_LIMIT_S = 150  # no replica process may run longer than this


def replicas(out: Path, lighthouse: str, **common: Any) -> Replicas:
    """``examples/elastic/replica.py`` processes; the launcher's ``close`` kills what is left."""
    common.setdefault("outer_step_timeout", OUTER_STEP_TIMEOUT)
    return Replicas(REPLICA, out, lighthouse, limit_s=RUN_LIMIT_S, **common)


def run_to_the_end(launcher: Replicas, options: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Starts each replica with its options, waits for every one to exit with 0, and returns their records."""
    try:
        procs = {rid: launcher.start(rid, **extra) for rid, extra in options.items()}
        codes = {rid: launcher.wait(p) for rid, p in procs.items()}
    finally:
        launcher.close()
    assert codes == {rid: 0 for rid in options}, launcher.logs()
    return [launcher.record(rid) for rid in options]


@pytest.fixture
def lighthouse():
    with Lighthouse(min_replicas=2, heartbeat_timeout_ms=1500, join_timeout_ms=20_000) as server:
        yield server.address


def csv_logged(out: Path, replica_id: str, pid: int) -> dict[int, float]:
    """step -> learning rate, as the replica process ``pid`` logged them (``replica.py --csv``)."""
    import csv

    with open(out / "csv" / replica_id / str(pid) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    column = next(c for c in rows[0] if c.startswith("lr-"))
    return {int(r["step"]): float(r[column]) for r in rows if r.get(column)}


def first_losses(losses: list[list[float]]) -> float:
    """The mean of a replica's first three losses."""
    return sum(loss for _, _, loss in losses[:3]) / 3


def replica_module() -> Any:
    """``examples/elastic/replica.py`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("elastic_replica", REPLICA)
    replica = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replica)
    return replica


def initial_checksum() -> list[float]:
    """The plug-in's checksum of the replicas' shared initial weights (as replica.py builds the model)."""
    from lightning_loco.elastic.plugin import checksum

    model = replica_module().Regressor("any", 0.0, Path(os.devnull))
    return checksum([torch.cat([p.detach().reshape(-1) for p in model.parameters()])])


def fresh_loss(replica_id: str) -> float:
    """The loss of the replicas' shared initial model on ``replica_id``'s data (as replica.py builds both)."""
    replica = replica_module()
    model = replica.Regressor(replica_id, 0.0, Path(os.devnull))
    x, y = replica.shard(replica_id).tensors
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model.net(x), y).item()


def falls(losses: list[list[float]], start: float | None = None) -> bool:
    """The last fifth of a replica's losses average under half of ``start``: by default its first three (the
    shared initial model's, whatever happened in between; steps are few and small batches noisy). A replica
    that joined late and healed starts from trained weights: pass the fresh model's losses then."""
    values = [loss for _, _, loss in losses]
    k = max(3, len(values) // 5)
    return sum(values[-k:]) / k < 0.5 * (first_losses(losses) if start is None else start)


def check_agreement(records: dict[str, dict[str, Any]]) -> int:
    """Every round a replica took with partners, each of those partners that left a record took with the same
    group (nobody waits on a partner that does not wait for it). Returns the rounds checked."""
    groups = {(rid, r["outer_step"]): tuple(r["group"]) for rid, rec in records.items() for r in rec["rounds"]}
    checked = 0
    for (rid, t), group in groups.items():
        for other in group:
            if other != rid and (other, t) in groups:
                assert groups[(other, t)] == group, f"round {t}: {rid} met {group}, {other} met {groups[(other, t)]}"
                checked += 1
    return checked


@pytest.mark.slow
def test_kill_in_inner_phase_and_in_exchange_then_rejoin(tmp_path: Path, lighthouse: str) -> None:
    """Four replicas. r3 is killed (SIGKILL) in an inner phase and restarted under the same id; r2 kills
    itself right after posting the exchange of its 10th round, with its partners' round in flight. The
    others finish fit, their losses fall, partners agree on every round, no exchange waits longer than
    the outer-step timeout, and the restarted r3 takes the weights of a live replica and meets the
    others from the first round of the membership that admits it. With AdamW and the shipped GPT's warm-up
    + cosine schedule: the restarted r3 takes its donor's step and learning rate, its logged steps go on
    from there, and every live replica stops at max_steps, its last checkpoint at that step."""
    launcher = replicas(tmp_path, lighthouse, max_steps=MAX_STEPS, sync_every=2, step_sleep=0.1, optimizer="adamw",
                        csv=True)
    try:
        # r0 and r1 wait before step 60 until the restarted r3 asks to join: they have 15 rounds left to take
        # it in, however long its restart takes on a loaded machine
        procs = {rid: launcher.start(rid, save_ckpt=tmp_path / f"{rid}.ckpt",
                                     **({"die_in_exchange_at": 10} if rid == "r2" else {}),
                                     **({"hold_at": 60} if rid in ("r0", "r1") else {}))
                 for rid in ("r0", "r1", "r2", "r3")}
        launcher.wait_for_step("r3", 11, procs["r3"])  # step 11 of H = 2: in the inner phase of outer step 5
        assert launcher.kill(procs["r3"]) == -signal.SIGKILL
        restarted = launcher.start("r3", save_ckpt=tmp_path / "r3.ckpt")  # its progress file goes first
        launcher.wait_for_log("r3.1", "asks the Lighthouse", restarted)
        launcher.release("r0")
        launcher.release("r1")
        codes = {rid: launcher.wait(p) for rid, p in [*procs.items(), ("r3'", restarted)] if rid != "r3"}
    finally:
        launcher.close()
    assert codes == {"r0": 0, "r1": 0, "r2": -signal.SIGKILL, "r3'": 0}, launcher.logs()
    records = {rid: launcher.record(rid) for rid in ("r0", "r1", "r3")}
    survivors = [records["r0"], records["r1"]]

    # the survivors finished every round from their first (a replica that asked the Lighthouse after the first
    # min_replicas did joins as the others' first membership starts, healed), and their losses fell
    for rid, rec in zip(("r0", "r1"), survivors):
        steps = [r["outer_step"] for r in rec["rounds"]]
        first = steps[0]
        assert rec["outer_steps"] == 45 and steps == sorted(set(steps)) and steps[-1] == 44
        # a survivor still busy with a broken group when the next quorum forms is left out of that membership
        # and sits its rounds out: it misses rounds only where it rejoined, healed to a later round
        healed_at = {h["outer_step"] for h in rec["healed_from"]}
        assert all(b in healed_at for a, b in zip(steps, steps[1:]) if b != a + 1), (steps, healed_at)
        assert first == rec["memberships"][0]["first_round"]
        assert falls(rec["losses"], fresh_loss(rid)), rec["losses"]
        assert max(rec["comm_seconds"]) < OUTER_STEP_TIMEOUT
    # r2's death in its exchange left a partner alone (in that round if r2's payload had not reached it, then
    # in the rest of the membership, whose process group the failure broke); rounds were taken alone only in
    # memberships that listed a replica that died (r2, or r3 before it was restarted)
    assert any(r["alone"] for rec in survivors for r in rec["rounds"] if "r2" in r["group"])
    for rec in survivors:
        members = {m["quorum_id"]: m["members"] for m in rec["memberships"]}
        rejoined = max(m["quorum_id"] for m in rec["memberships"] if "r3" in m["joiners"])
        for r in rec["rounds"]:
            if r["alone"]:
                assert "r2" in members[r["quorum_id"]] or r["quorum_id"] < rejoined, r
    # the memberships dropped r2 after it died, and took r3 back
    final = survivors[0]["memberships"][-1]["members"]
    assert "r2" not in final and "r3" in final and final == survivors[1]["memberships"][-1]["members"]
    assert check_agreement(records) > 20

    # the restarted r3 healed from a live replica: its weights are the donor's, at the donor's outer step
    rejoin = records["r3"]
    heal = rejoin["healed_from"][0]
    assert heal["donor"] in ("r0", "r1") and heal["weights"]
    donor_export = [e for e in records[heal["donor"]]["exported"] if e["outer_step"] == heal["outer_step"]]
    assert donor_export and donor_export[0]["checksum"] == pytest.approx(heal["checksum"], rel=1e-12)
    # ... and took part from that outer step on, with partners that agree
    assert rejoin["rounds"][0]["outer_step"] == heal["outer_step"] == rejoin["memberships"][0]["first_round"]
    assert [r["outer_step"] for r in rejoin["rounds"]] == list(range(heal["outer_step"], 45))
    assert not any(r["alone"] for r in rejoin["rounds"])

    # ... with the donor's whole training state: its step and learning rate at the switch are the donor's, its
    # steps go on from there (none counted twice, none missed), at the learning rates of every other replica
    healed_at = heal["inner_steps"]
    assert healed_at == 2 * heal["outer_step"] and heal["extra_checksum"] == donor_export[0]["extra_checksum"]
    lrs = {rid: dict(map(tuple, rec["steps"])) for rid, rec in records.items()}
    assert [step for step, _ in rejoin["steps"]] == list(range(healed_at, MAX_STEPS))
    for step, lr in lrs["r3"].items():
        assert lr == lrs[heal["donor"]][step] == lrs["r0"].get(step, lr) == lrs["r1"].get(step, lr), step
    logged = csv_logged(tmp_path, "r3", restarted.pid)
    assert sorted(logged) == list(range(healed_at, MAX_STEPS))  # the logger's steps continue the run's
    donor_logged = csv_logged(tmp_path, heal["donor"], procs[heal["donor"]].pid)
    assert all(logged[step] == donor_logged[step] for step in logged)
    # every live replica stopped at max_steps (Lightning's own stop) and says so; its last checkpoint is there
    for rid, rec in records.items():
        assert rec["global_step"] == MAX_STEPS, rid
        assert torch.load(tmp_path / f"{rid}.ckpt", weights_only=False)["global_step"] == MAX_STEPS, rid
    text = {name: (tmp_path / name).read_text() for name in ("r0.0.log", "r1.0.log", "r3.1.log")}
    for name, lines in text.items():
        assert f"training ended at step {MAX_STEPS}, the run's max_steps" in lines, name
        assert f"`max_steps={MAX_STEPS}` reached" in lines, name
    assert f"took its state from {heal['donor']!r}" in text["r3.1.log"]
    assert re.search(r"left: \[[^]]*'r2'", text["r0.0.log"] + text["r1.0.log"])  # the membership change, said


@pytest.mark.slow
def test_resume_from_own_checkpoint_instead_of_healing(tmp_path: Path, lighthouse: str) -> None:
    """GASLoC. r0 and r1 train and save their own checkpoints. Then r0 resumes from its file while r1 starts
    afresh with heal=False: r0 goes on from its own outer step, state and weights (nobody heals it: it is
    the furthest), and r1 takes only the outer-step count from r0 and keeps its own weights."""
    launcher = replicas(tmp_path, lighthouse, algorithm="gasloc", sync_every=2, step_sleep=0.0)
    try:
        first = [launcher.start(rid, max_steps=16, save_ckpt=tmp_path / f"{rid}.ckpt") for rid in ("r0", "r1")]
        assert [launcher.wait(p) for p in first] == [0, 0], launcher.logs()
        before = {rid: launcher.record(rid) for rid in ("r0", "r1")}
        second = [launcher.start("r0", max_steps=32, ckpt_path=tmp_path / "r0.ckpt"),
                  launcher.start("r1", max_steps=32, no_heal=True)]
        assert [launcher.wait(p) for p in second] == [0, 0], launcher.logs()
    finally:
        launcher.close()
    after = {rid: launcher.record(rid) for rid in ("r0", "r1")}
    assert before["r0"]["outer_steps"] == 8 and after["r0"]["outer_steps"] == 16
    # r0: its own state, from where it stopped
    assert after["r0"]["healed_from"] == [] and after["r0"]["rounds"][0]["outer_step"] == 8
    assert after["r0"]["memberships"][0]["joiners"] == ["r1"] and after["r0"]["exported"][0]["outer_step"] == 8
    assert after["r0"]["losses"][0][2] < 0.5 * before["r0"]["losses"][0][2]  # it did not start over
    # r1: r0's count, its own fresh weights (the model's initial ones: its first loss is a fresh start's)
    heal = after["r1"]["healed_from"][0]
    assert heal == {**heal, "donor": "r0", "outer_step": 8, "weights": False}
    assert heal["checksum"] != pytest.approx(after["r0"]["exported"][0]["checksum"])
    assert heal["checksum"] == initial_checksum()  # exactly the initial weights: nothing of r0's was taken
    assert [r["outer_step"] for r in after["r1"]["rounds"]] == list(range(8, 16))
    assert check_agreement(after) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["noloco", "diloco"])
def test_a_late_replica_is_left_out_of_a_round_and_nobody_stops(tmp_path: Path, lighthouse: str,
                                                                 algorithm: str) -> None:
    """Two replicas with straggler_timeout: r1 sleeps well past it before its outer step 4. r0 gives up on it
    and takes that round alone (DiLoCo: drops it); r1 takes it alone too when it gets there; nobody fails,
    leaves the membership or stops early, and both take the same rounds to the end (DiLoCo: one anchor)."""
    launcher = replicas(tmp_path, lighthouse, algorithm=algorithm, max_steps=30, sync_every=2, step_sleep=0.05,
                        straggler_timeout=2.0)
    r0, r1 = run_to_the_end(launcher, {"r0": {}, "r1": {"slow_at": 4, "slow_seconds": 6.0}})
    for record in (r0, r1):
        assert record["failures"] == [] and record["global_step"] == 30 and record["outer_steps"] == 15
        assert all(m["members"] == ["r0", "r1"] for m in record["memberships"])
        rounds = {r["outer_step"]: r for r in record["rounds"]}
        assert rounds[4]["alone"] and rounds[4]["dropped"] == (algorithm == "diloco")
        assert not all(rounds[t]["alone"] for t in range(6, 15))  # they meet again (the switches resync them)
    assert (4, ["r1"], True) in [(x["outer_step"], x["peers"], x["gave_up"]) for x in r0["late"]]
    assert (4, ["r0"], False) in [(x["outer_step"], x["peers"], x["gave_up"]) for x in r1["late"]]
    pattern = [[(r["outer_step"], r["alone"]) for r in record["rounds"]] for record in (r0, r1)]
    assert pattern[0] == pattern[1]  # a round is the pair's on both or on neither
    if algorithm == "diloco":
        assert r0["final_weights"] == pytest.approx(r1["final_weights"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, wire", [("noloco", {"wire": "bfloat16"}),
                                             ("diloco", {"wire": "int8"})], ids=["noloco-bf16", "diloco-int8"])
def test_lossy_wire_formats_over_real_elastic_groups(tmp_path: Path, lighthouse: str, algorithm: str,
                                                      wire: dict[str, str]) -> None:
    """bf16 and int8 (DiLoCo: with error feedback) over gloo between two replica processes: every round is
    exchanged, DiLoCo's members end with one anchor (the chunked all-reduce is bitwise the same on both), and
    the losses fall."""
    launcher = replicas(tmp_path, lighthouse, algorithm=algorithm, max_steps=30, sync_every=2, step_sleep=0.0, **wire)
    r0, r1 = run_to_the_end(launcher, {"r0": {}, "r1": {}})
    for record in (r0, r1):
        assert record["failures"] == [] and record["outer_steps"] == 15
        assert not any(r["alone"] for r in record["rounds"])
        assert falls(record["losses"], fresh_loss(record["replica_id"]))
    if algorithm == "diloco":
        assert r0["final_weights"] == r1["final_weights"]


@pytest.mark.slow
def test_diloco_drops_dead_replicas_from_the_average(tmp_path: Path, lighthouse: str) -> None:
    """DiLoCo, four replicas: r3 is killed in an inner phase, r2 kills itself inside the all-reduce of its
    fourth round. r0 and r1 finish with the same anchor (their final weights are equal), a round whose
    all-reduce failed on one of them only is healed from the other, the memberships leave out r2 and r3, and
    losses fall."""
    # gloo's ring all-reduce may not notice a dead member before its timeout: a short one keeps the test short
    launcher = replicas(tmp_path, lighthouse, algorithm="diloco", max_steps=40, sync_every=2, step_sleep=0.05,
                        outer_step_timeout=5.0, hold_at=0)
    try:
        procs = {rid: launcher.start(rid, **({"die_in_exchange_at": 4} if rid == "r2" else {}))
                 for rid in ("r0", "r1", "r2", "r3")}
        # all four ask for their first membership together (on a loaded machine a replica slow to start could
        # otherwise miss both deaths, or the survivors could), and r3 is killed in a membership with a survivor
        for rid, proc in procs.items():
            launcher.wait_until_held(rid, proc)
        for rid in procs:
            launcher.release(rid)
        launcher.wait_for_log("r3.0", r"membership \d+ from outer step \d+: \[[^]]*'r[01]'", procs["r3"])
        launcher.wait_for_step("r3", 7, procs["r3"])
        launcher.kill(procs["r3"])
        codes = {rid: launcher.wait(p) for rid, p in procs.items()}
    finally:
        launcher.close()
    assert codes == {"r0": 0, "r1": 0, "r2": -signal.SIGKILL, "r3": -signal.SIGKILL}, launcher.logs()
    r0, r1 = launcher.record("r0"), launcher.record("r1")
    assert r0["final_weights"] == pytest.approx(r1["final_weights"], abs=1e-6)
    # a round both took part in is dropped alike on both, or (the all-reduce completed on one member and failed on
    # the other) the one that dropped it has a round fewer and heals from the other at the next switch
    records = {"r0": r0, "r1": r1}
    dropped = {rid: {r["outer_step"]: r["dropped"] for r in rec["rounds"]} for rid, rec in records.items()}
    for t in sorted(dropped["r0"].keys() & dropped["r1"].keys()):
        if dropped["r0"][t] != dropped["r1"][t]:
            behind, ahead = ("r0", "r1") if dropped["r0"][t] else ("r1", "r0")
            heals = [h for h in records[behind]["healed_from"] if h["outer_step"] > t]
            assert heals and heals[0]["donor"] == ahead, (t, behind, records[behind]["healed_from"])
    # a round was dropped on the survivors: r3 died in one of their memberships
    assert any(r["dropped"] for rec in (r0, r1) for r in rec["rounds"])
    assert r0["memberships"][-1]["members"] == ["r0", "r1"] == r1["memberships"][-1]["members"]
    # one of them, or both, may have joined a round or two late and healed: each is held to the fresh model's
    # loss on its own data
    assert falls(r0["losses"], fresh_loss("r0")) and falls(r1["losses"], fresh_loss("r1"))


@pytest.mark.slow
def test_a_lighthouse_that_died_fails_the_next_switch_naming_what_happened() -> None:
    """The request fails at once when the Lighthouse is gone: the error says so, with the time it took,
    not that join_timeout expired."""
    from lightning_loco.elastic.config import ElasticConfig
    from lightning_loco.elastic.membership import Membership

    cli = [sys.executable, "-m", "lightning_loco.cli", "lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0"]
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    membership = None
    try:
        address = proc.stdout.readline().split()[1]
        membership = Membership(ElasticConfig(lighthouse=address, replica_id="solo", join_timeout=600.0))
        nothing = {"driver": [], "weights": []}
        assert membership.at_switch(0, lambda: nothing, lambda state, heal: 0) == 0  # a run of one starts
        assert membership.view is not None and membership.view.members == ("solo",)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        with pytest.raises(RuntimeError) as failed:
            # the next membership may have been answered before the kill; the one after cannot be
            for next_round in (1, 2):
                membership.at_switch(next_round, lambda: nothing, lambda state, heal, t=next_round: t)
        message = str(failed.value)
        assert "request failed after" in message and "join_timeout" not in message, message
    finally:
        if membership is not None:
            membership.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _HeldClient:
    """A Lighthouse client whose quorum calls wait for ``release`` before they go to the Lighthouse."""

    def __init__(self, client: Any) -> None:
        import threading

        self.client, self.release, self.asked = client, threading.Event(), threading.Event()

    def quorum(self, **kwargs: Any) -> Any:
        self.asked.set()
        self.release.wait()
        return self.client.quorum(**kwargs)


@pytest.mark.slow
def test_close_waits_for_the_membership_asked_ahead_and_shuts_its_group() -> None:
    """A replica that ends with the next membership still in flight (asked for at its last switch) closes only
    once that request is out of torchft, and shuts down the group it set up: a torchft call that returns while
    the interpreter exits aborts the process ('FATAL: exception not rethrown'; seen when three CLI replicas
    ended together on a loaded machine)."""
    import threading

    from lightning_loco.elastic.config import ElasticConfig
    from lightning_loco.elastic.membership import Membership

    with Lighthouse(min_replicas=1) as lighthouse:
        membership = Membership(ElasticConfig(lighthouse=lighthouse.address, replica_id="solo"))
        nothing = {"driver": [], "weights": []}
        assert membership.at_switch(0, lambda: nothing, lambda state, heal: 0) == 0
        request = membership._request  # the next membership, asked for in the background
        assert request is not None
        held = membership._client = _HeldClient(membership._client)
        # the request in flight may have reached the Lighthouse already; the next one is held for certain
        membership._request = None
        membership._ask(1, current=True)
        request = membership._request
        assert held.asked.wait(60)
        closed = threading.Event()
        closer = threading.Thread(target=lambda: (membership.close(), closed.set()), daemon=True)
        closer.start()
        assert not closed.wait(1.0)  # held inside the quorum call: close waits for it
        held.release.set()
        assert closed.wait(60)
        assert not request.thread.is_alive()
        assert request.error is None and request.result is not None
        plan, pg = request.result
        assert plan.members == ("solo",) and pg is not None
        assert pg._pg is None  # torchft's shutdown() lets go of the group it wraps


@pytest.mark.slow
def test_sigterm_stops_a_replica_still_waiting_for_the_lighthouse(tmp_path: Path) -> None:
    """A Lighthouse address that accepts connections and never answers (a socket of this test): the replica's
    client connects and waits. SIGTERM stops it there: it says so and exits as Lightning does on SIGTERM,
    instead of waiting for its connect timeout or join_timeout (600 s) and failing on that."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(16)
    mute.settimeout(RUN_LIMIT_S)  # the test's own limit: the replica never connecting fails the test
    launcher = replicas(tmp_path, f"127.0.0.1:{mute.getsockname()[1]}", join_timeout=600.0)
    connections = []
    try:
        proc = launcher.start("r0")
        connections.append(mute.accept()[0])  # the replica's Lighthouse client has dialed: it is waiting
        proc.send_signal(signal.SIGTERM)
        code = launcher.wait(proc)
    finally:
        launcher.close()
        for connection in connections:
            connection.close()
        mute.close()
    text = launcher.logs()
    assert code == 0, text  # Lightning's SIGTERMException is a SystemExit: a clean stop
    assert "Replica 'r0' received SIGTERM while waiting for" in text, text
    assert "join_timeout" not in text and "could not reach" not in text, text
    assert not (tmp_path / "r0.json").exists()  # fit stopped: the replica wrote no record


@pytest.mark.slow
def test_a_lighthouse_that_refuses_connections_is_named_with_the_connect_timeout() -> None:
    """Nothing listens at the address: torchft retries until its connect timeout, and the error names that
    timeout (join_timeout capped at 30 s), not join_timeout itself."""
    from lightning_loco.elastic.config import ElasticConfig
    from lightning_loco.elastic.membership import Membership

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(RuntimeError) as failed:
        Membership(ElasticConfig(lighthouse=f"127.0.0.1:{port}", replica_id="solo", join_timeout=2.0))
    message = str(failed.value)
    assert "could not reach the Lighthouse" in message and "the connect timeout is 2 s" in message, message
    assert "lightning-loco lighthouse --min-replicas N" in message


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, killed_rank, sharding", [("noloco", 1, None), ("diloco", 0, "fsdp")],
                         ids=["noloco", "diloco-fsdp"])  # each algorithm, each way inside, each rank killed once
def test_a_replica_of_two_ranks_loses_a_rank_leaves_as_a_whole_and_heals_rank_by_rank(
        tmp_path: Path, algorithm: str, killed_rank: int, sharding: Optional[str]) -> None:
    """Replicas A and B of two ranks each (DDP inside, or FSDP2: ``sharding``), over a Lighthouse that lets one
    replica go on alone. One rank of B is killed (SIGKILL) mid-run: B's other rank stops with an error that
    says the replica leaves as a whole, within the bounded wait below; A goes on to max_steps. B is restarted
    as torchrun restarts a replica (all its ranks), and heals rank by rank: rank i takes the state of A's
    rank i (equal checksums of weights, outer state and training state: with FSDP2, rank i's own shards), and
    takes part from there to max_steps."""
    max_steps, timeout = 120, 10.0
    with Lighthouse(min_replicas=1, heartbeat_timeout_ms=1500, join_timeout_ms=5000) as server:
        launcher = replicas(tmp_path, server.address, algorithm=algorithm, max_steps=max_steps, sync_every=2,
                            step_sleep=0.2, outer_step_timeout=timeout, sharding=sharding)
        try:
            # A waits before step 80 until the restarted B asks to join: however long B's restart takes, A
            # has 20 rounds left to answer (a B that asked after A ended would wait for A's state in vain)
            a = launcher.start_ranks("A", 2, hold_at=max_steps - 40)
            b = launcher.start_ranks("B", 2)
            launcher.wait_for_step("B", 11, b[0])  # B's ranks step together (DDP): in an inner phase
            assert launcher.kill(b[killed_rank]) == -signal.SIGKILL
            other = b[1 - killed_rank]
            code = launcher.wait(other, timeout_s=3 * timeout + 30)  # bounded: never the 30-minute default
            # B is restarted once A has taken a membership without it (the Lighthouse counts B as dead only
            # after its heartbeat timeout: a restart before that would find B still a member)
            launcher.wait_for_log("A.0.r0", r"left: \['B'\]", a[0])
            restarted = launcher.start_ranks("B", 2)
            launcher.wait_for_log("B.1.r0", "asks the Lighthouse", restarted[0])
            launcher.release("A")
            codes = [launcher.wait(p) for p in [*a, *restarted]]
        finally:
            launcher.close()
    assert code not in (0, -signal.SIGKILL), launcher.logs()
    said = (tmp_path / f"B.0.r{1 - killed_rank}.log").read_text()
    assert f"Replica 'B' (rank {1 - killed_rank} of 2) stops: the replica leaves the membership as a whole" in said
    assert "Restart all 2 of its processes" in said, said[-3000:]
    assert codes == [0, 0, 0, 0], launcher.logs()
    records = {(rid, rank): launcher.record(rid, rank) for rid in ("A", "B") for rank in (0, 1)}

    # A went on to the end; its memberships dropped B after its rank died and took the restarted B back
    for rank in (0, 1):
        rec = records[("A", rank)]
        assert rec["global_step"] == max_steps and rec["outer_steps"] == max_steps // 2
        assert [r["outer_step"] for r in rec["rounds"]][-1] == max_steps // 2 - 1
        seen = [m["members"] for m in rec["memberships"]]
        with_b = seen.index(["A", "B"])
        assert ["A"] in seen[with_b:] and seen[-1] == ["A", "B"], seen  # B left as a whole, and came back
    assert re.search(r"left: \['B'\]", (tmp_path / "A.0.r0.log").read_text())
    assert records[("A", 0)]["rounds"] == [{**r, "time": x["time"]} for r, x in
                                           zip(records[("A", 1)]["rounds"], records[("A", 0)]["rounds"])]

    # the restarted B healed rank by rank from A's same rank, at one outer step, and went on to max_steps
    heals = [records[("B", rank)]["healed_from"][-1] for rank in (0, 1)]
    assert heals[0]["outer_step"] == heals[1]["outer_step"] and all(h["donor"] == "A" and h["weights"] for h in heals)
    for rank, heal in enumerate(heals):
        sent = [e for e in records[("A", rank)]["exported"] if e["outer_step"] == heal["outer_step"]]
        assert sent and (sent[-1]["checksum"], sent[-1]["extra_checksum"]) == (heal["checksum"], heal["extra_checksum"])
        rec = records[("B", rank)]
        assert rec["global_step"] == max_steps and rec["outer_steps"] == max_steps // 2
        assert rec["rounds"][0]["outer_step"] == heal["outer_step"] == rec["memberships"][0]["first_round"]
        assert [step for step, _ in rec["steps"]] == list(range(heal["inner_steps"], max_steps))
    if sharding is None:
        assert heals[0]["checksum"] == heals[1]["checksum"]  # one model on B's two ranks, as on A's
        for rid in ("A", "B"):
            assert records[(rid, 0)]["final_weights"] == records[(rid, 1)]["final_weights"], rid
    else:  # each rank holds its own shards (uneven: 89 and 72 of the 161 values), and heals them alone
        assert heals[0]["checksum"] != heals[1]["checksum"]
        for rid in ("A", "B"):
            assert [len(records[(rid, rank)]["final_weights"]) for rank in (0, 1)] == [89, 72], rid
    if algorithm == "diloco":  # one anchor for the run: the replicas end equal, rank by rank
        for rank in (0, 1):
            assert records[("A", rank)]["final_weights"] == pytest.approx(records[("B", rank)]["final_weights"],
                                                                          abs=1e-6)


# ---------------------------------------------------------------- data: each elastic replica reads its own

DATA_CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 4
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: tiny.BatchLog
      init_args: {{out: {out}}}
  strategy:
    class_path: lightning_loco.NoLoCoStrategy
    init_args:
      sync_every: 2
      elastic: {{lighthouse: "{lighthouse}", outer_step_timeout: 60, data_slots: 3}}
model:
  class_path: tiny.TinyRegressor
"""


@pytest.mark.slow
def test_three_elastic_replicas_from_the_cli_recipe_read_disjoint_parts_of_the_data(tmp_path: Path) -> None:
    """docs/elastic.md's recipe (a Lighthouse, then one `lightning-loco fit` per replica with its id) with
    data_slots=3: replicas site-0, site-1 and site-2 each read their own third of the 48 samples in their
    epoch, as the three replicas of a static launch would: pairwise disjoint, all of them together."""
    import tiny

    with Lighthouse(min_replicas=3) as lighthouse:
        config = tmp_path / "replica.yaml"
        config.write_text(DATA_CONFIG.format(out=tmp_path / "batches", lighthouse=lighthouse.address))
        env = child_env(PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))  # no inherited MASTER_PORT
        procs = [subprocess.Popen([sys.executable, "-m", "lightning_loco.cli", "fit", "--config", str(config),
                                   f"--trainer.strategy.init_args.elastic.replica_id=site-{r}"],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True) for r in range(3)]
        try:
            outputs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    assert not any("may train on the same batches" in o for o in outputs)
    seen = {r: [tuple(row) for batch in json.loads((tmp_path / "batches" / f"site-{r}.rank0.json").read_text())
                for row in batch] for r in range(3)}
    everything = {tuple(row) for row in tiny.dataset().tensors[0].tolist()}
    assert all(len(rows) == len(set(rows)) == 16 for rows in seen.values())  # 4 batches of 4, no repeats
    assert set(seen[0]) | set(seen[1]) | set(seen[2]) == everything
    assert not set(seen[0]) & set(seen[1]) and not set(seen[0]) & set(seen[2]) and not set(seen[1]) & set(seen[2])
