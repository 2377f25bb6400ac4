"""Replicas that span several ranks (``ranks_per_replica``): DDP inside a replica, the outer step
between replicas, the sliced exchange, checkpoints, and bad input."""

import glob
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from test_multiprocess import PAPERS, noloco_outer, reference

import lightning_loco
from lightning_loco.testing.launch import free_port, init_gloo, start_ranks
from lightning_loco.transport import TorchDistributedTransport

import tiny
from test_checkpoints import assert_same_tree

run = tiny.launch


def test_two_replicas_of_two_ranks_equal_two_replicas_with_the_union_batch(tmp_path):
    h, steps = 3, 9
    recs = run(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": h, "ranks_per_replica": 2, **PAPERS},
               devices=4, max_steps=steps)
    expected = reference(2, steps, h, noloco_outer(0.5, 0.7, 0.7, 2), ranks_per_replica=2)  # union batches
    numel = recs[0]["outer_states"][0]["numel"]
    for r, rec in enumerate(recs):
        replica = r // 2
        mine = torch.tensor_split(torch.empty(numel), 2)[r % 2].numel()  # this rank's slice
        for step, (got, want) in enumerate(zip(rec["weights"], expected[replica])):
            assert torch.allclose(got.double(), want.double(), atol=2e-5), (r, step)
        # the two ranks of a replica hold bitwise the same weights after every step
        assert all(torch.equal(w, v) for w, v in zip(rec["weights"], recs[replica * 2]["weights"]))
        # DDP inside the replica runs on the replica's own group, never across replicas
        assert rec["ddp_group_ranks"] == [2 * replica, 2 * replica + 1]
        # the outer step: rank j swaps its half with rank j of the other replica, then the replica all-gathers
        peer_rank = 2 * (1 - replica) + r % 2
        for i in (h - 1, 2 * h - 1, 3 * h - 1):
            assert rec["calls"][i] == [("batch_isend_irecv", (("irecv", peer_rank, mine), ("isend", peer_rank, mine))),
                                       ("all_gather",)]
        assert [i for i, calls in enumerate(rec["calls"]) if calls] == [h - 1, 2 * h - 1, 3 * h - 1]
        assert [x["peers"] for x in rec["reports"]] == [(1 - replica,)] * 3  # peers are replicas, not ranks
        assert [x["bytes_sent"] for x in rec["reports"]] == [4 * mine] * 3
    assert not torch.equal(recs[0]["weights"][h], recs[2]["weights"][h])  # replicas differ between outer steps


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["diloco", "gasloc"])
def test_diloco_and_gasloc_between_replicas_of_two_ranks(tmp_path, algorithm):
    h, steps = 4, 8
    recs = run(tmp_path, strategy=algorithm, devices=4, max_steps=steps,
               strategy_kwargs={"sync_every": h, "ranks_per_replica": 2,
                                "overlap_steps": 1 if algorithm == "gasloc" else 0})
    for r, rec in enumerate(recs):
        assert all(torch.equal(w, v) for w, v in zip(rec["weights"], recs[r - r % 2]["weights"]))
    if algorithm == "diloco":  # one shared anchor: all four ranks equal after each outer step
        for step in (h - 1, 2 * h - 1):
            assert all(torch.equal(recs[0]["weights"][step], rec["weights"][step]) for rec in recs)
        # two replicas on gloo: the all-reduce of each slice is one pair exchange with the counterpart rank
        numel = recs[0]["outer_states"][0]["numel"]
        for r, rec in enumerate(recs):
            peer, mine = (r + 2) % 4, torch.tensor_split(torch.empty(numel), 2)[r % 2].numel()
            assert rec["calls"][h - 1] == [("batch_isend_irecv", (("irecv", peer, mine), ("isend", peer, mine))),
                                           ("all_gather",)]
    else:  # overlapped: the landing all-gathers, one step after the start
        assert [x["inner_step"] for x in recs[0]["reports"]] == [h + 1]
        assert not torch.equal(recs[0]["weights"][h], recs[2]["weights"][h])


@pytest.mark.slow
def test_exact_resume_with_replicas_of_two_ranks(tmp_path):
    k_save = 6
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": k_save, "save_top_k": -1}
    common = {"strategy": "noloco", "strategy_kwargs": {"sync_every": 4, "ranks_per_replica": 2}, "devices": 4,
              "max_steps": 2 * k_save}
    straight = run(tmp_path / "straight", checkpoint=checkpoint, **common)
    middle = ckpts / f"step={k_save}.ckpt"
    files = sorted(glob.glob(str(ckpts / ".replicas" / f"step={k_save}.ckpt-*" / "replica-*.pt")))
    assert [os.path.basename(f) for f in files] == ["replica-00000.pt", "replica-00001.pt"]  # one per replica
    resumed = run(tmp_path / "resumed", ckpt_path=str(middle), **common)
    for r in range(4):
        for step, (a, b) in enumerate(zip(straight[r]["weights"][k_save:], resumed[r]["weights"])):
            assert torch.equal(a, b), (r, k_save + step)
        assert_same_tree(straight[r]["outer_states"], resumed[r]["outer_states"], "outer")


def test_bad_ranks_per_replica():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="ranks_per_replica must be an integer >= 1"):
            lightning_loco.NoLoCoStrategy(ranks_per_replica=bad)
    with pytest.raises(ValueError, match="ranks_per_replica=3 does not divide the 4 processes"):
        L.Trainer(strategy=lightning_loco.DiLoCoStrategy(ranks_per_replica=3), accelerator="cpu", devices=4)
    # GASLoC's exponential topology counts replicas, not processes: 8 processes in replicas of 2 is 4 replicas
    L.Trainer(strategy=lightning_loco.GASLoCStrategy(topology="exponential", ranks_per_replica=2),
              accelerator="cpu", devices=8)
    with pytest.raises(ValueError, match="power-of-two number of replicas, got 3"):
        L.Trainer(strategy=lightning_loco.GASLoCStrategy(topology="exponential", ranks_per_replica=2),
                  accelerator="cpu", devices=6)


def _sliced_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 4, port=port, timeout_s=30)
    try:
        replica_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        slice_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        sliced = TorchDistributedTransport(torch.device("cpu"), ranks_per_replica=2,
                                           replica_group=replica_groups[rank // 2], slice_group=slice_groups[rank % 2])
        payload = torch.linspace(-1, 1, 7) * (rank // 2 + 1) + 0.001 * (rank // 2)  # the same on a replica's ranks
        out = {"pair": sliced.group_sum(payload, (0, 1)), "all": sliced.all_reduce_sum(payload.clone()),
               "bytes": sliced.stats.bytes_sent, "replica": sliced.replica}
        # the whole-buffer exchange between ranks 0 and 2 (one rank per replica)
        if rank in (0, 2):
            out["whole"] = TorchDistributedTransport(torch.device("cpu")).group_sum(payload, (0, 2))
        dist.barrier()
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_sliced_exchange_equals_a_whole_model_exchange(tmp_path):
    start_ranks(_sliced_worker, 4, args=(free_port(), str(tmp_path)), start_method="spawn", timeout_s=240)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(4)]
    assert [x["replica"] for x in res] == [0, 0, 1, 1]
    for x in res:
        assert torch.equal(x["pair"], res[0]["whole"])  # bitwise: the same sums in the same order
        assert torch.allclose(x["all"], res[0]["whole"])
    assert torch.equal(res[0]["whole"], res[2]["whole"])
    # each rank sends its slice only (4 and 3 of 7 floats): pair exchange plus the all-reduce's nominal figure
    assert [x["bytes"] for x in res] == [16 + 16, 12 + 12, 16 + 16, 12 + 12]
