"""FSDP2 inside each replica (``replica_sharding="fsdp"``): the outer step on local shards against DDP
inside a replica (``ranks_per_replica=2`` alone), the bytes and outer state of each rank, sharded
checkpoints, modules written for Lightning's ``ModelParallelStrategy``, and bad input.

The runs are 2 replicas × 2 ranks (gloo, CPU). A sharded run starts its ranks with Lightning's popen
launcher (a sharded model cannot go back whole to a forking parent), the DDP-inside runs it is
compared with by forking.
"""

import copy
import csv
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_multiprocess import PAPERS, noloco_outer, reference
from torch import nn

import lightning_loco
from lightning_loco.replica import checkpoints
from lightning_loco.testing.launch import free_port, init_gloo, start_ranks
from lightning_loco.wire.codecs import make_codec

import tiny
from test_checkpoints import assert_same_tree

ROOT = Path(__file__).parent.parent
run = tiny.launch
SHARDED = {"ranks_per_replica": 2, "replica_sharding": "fsdp"}


def run_pair(tmp_path, strategy, kwargs, sharded_only=None, **config):
    """The same run with DDP inside each replica and with FSDP2 inside (``sharded_only``: more
    configuration for the latter)."""
    ddp = run(tmp_path / "ddp", strategy=strategy, strategy_kwargs={**kwargs, "ranks_per_replica": 2}, devices=4,
              **config)
    fsdp = run(tmp_path / "fsdp", strategy=strategy, strategy_kwargs={**kwargs, **SHARDED}, devices=4,
               start_method="popen", **config, **(sharded_only or {}))
    return ddp, fsdp


def local_numels(shard: int, k: int = 2) -> int:
    """Elements of the tiny model rank ``shard`` of a replica holds: FSDP2 cuts every parameter along
    its first dimension as ``torch.chunk`` does."""
    model = tiny.TinyRegressor()
    parts = [p.chunk(k)[shard] if shard < len(p.chunk(k)) else p[:0] for p in model.parameters()]
    return sum(p.numel() for p in parts)


def assert_close_runs(a, b, atol=1e-6):
    for r in range(4):
        assert len(a[r]["weights"]) == len(b[r]["weights"])
        for step, (x, y) in enumerate(zip(a[r]["weights"], b[r]["weights"])):
            assert torch.allclose(x, y, atol=atol), (r, step, (x - y).abs().max())


def test_noloco_on_local_shards_equals_ddp_inside(tmp_path):
    """A module written for ModelParallelStrategy (configure_model shards it over
    self.device_mesh["data_parallel"]) trains unchanged; its trajectory is DDP inside's and the
    closed form's; each rank sends and keeps only its own shards."""
    h, steps = 3, 9
    ddp, fsdp = run_pair(tmp_path, "noloco", {"sync_every": h, **PAPERS}, max_steps=steps,
                         sharded_only={"model_parallel": True}, record_consensus=True)
    assert_close_runs(ddp, fsdp)
    expected = reference(2, steps, h, noloco_outer(0.5, 0.7, 0.7, 2), ranks_per_replica=2)
    whole = ddp[0]["outer_states"][0]["numel"]
    assert local_numels(0) + local_numels(1) == whole
    for r, rec in enumerate(fsdp):
        replica, shard = divmod(r, 2)
        for step, (got, want) in enumerate(zip(rec["weights"], expected[replica])):
            assert torch.allclose(got.double(), want.double(), atol=2e-5), (r, step)
        # FSDP's collectives run on the replica's own two ranks
        assert rec["fsdp_group_ranks"] == [(2 * replica, 2 * replica + 1)]
        # the outer state is this rank's shards only, in float32
        mine = local_numels(shard)
        state = rec["outer_states"][0]
        assert state["numel"] == mine and state["anchor_dtype"] == "torch.float32"
        assert state["state"]["anchor"].numel() == state["state"]["momentum"].numel() == mine
        # rank j sends its own shards to rank j of the other replica and gathers nothing
        peer_rank = 2 * (1 - replica) + shard
        for i in (h - 1, 2 * h - 1, 3 * h - 1):
            assert rec["calls"][i] == [("batch_isend_irecv", (("irecv", peer_rank, mine), ("isend", peer_rank, mine)))]
        assert [i for i, calls in enumerate(rec["calls"]) if calls] == [h - 1, 2 * h - 1, 3 * h - 1]
        assert [x["bytes_sent"] for x in rec["reports"]] == [4 * mine] * 3
    # between them, the two ranks of a replica send the model once: what one DDP-inside rank's slice adds up to
    assert sum(fsdp[r]["reports"][0]["bytes_sent"] for r in (0, 1)) == 4 * whole
    assert sum(ddp[r]["reports"][0]["bytes_sent"] for r in (0, 1)) == 4 * whole
    # average_at_end: after fit every rank holds the consensus, as with DDP inside
    after = [torch.load(tmp_path / mode / "out" / f"after_fit{r}.pt")["weights"] for mode in ("ddp", "fsdp")
             for r in range(4)]
    assert all(torch.allclose(w, after[0], atol=1e-6) for w in after)
    # after fit the sharded module's parameters are still DTensor shards; consensus_state_dict() gives the full
    # average as plain tensors, on global rank 0 (every rank with DDP inside), ready for torch.save
    assert sorted(p.name for p in (tmp_path / "fsdp" / "out").glob("consensus*.pt")) == ["consensus0.pt"]
    assert len(list((tmp_path / "ddp" / "out").glob("consensus*.pt"))) == 4
    full = torch.load(tmp_path / "fsdp" / "out" / "consensus0.pt")
    plain = torch.load(tmp_path / "ddp" / "out" / "consensus0.pt")
    assert full.keys() == plain.keys() and all(type(v) is torch.Tensor for v in full.values())
    assert all(torch.allclose(full[k], plain[k], atol=1e-6) for k in full)
    assert torch.allclose(torch.cat([full[k].reshape(-1) for k in full if "weight" in k or "bias" in k]).sum(),
                          after[0].sum(), atol=1e-5)


def test_every_rank_of_a_sharded_replica_starts_from_global_rank_0s_full_weights(tmp_path):
    """The automatic FSDP2 policy shards a module whose ranks initialised differently: every rank of every
    replica starts from global rank 0's full weights, as DDP inside does (not from a replica stitched from
    its ranks' shards)."""
    # (the sharded run's ranks are started processes that each build the module; the forked DDP-inside run
    # builds it once, in the parent, so it is the reference with one init)
    ddp, fsdp = run_pair(tmp_path, "noloco", {"sync_every": 2, **PAPERS}, max_steps=4,
                         sharded_only={"rank_dependent_init": True})
    rank0 = tiny.flat(tiny.TinyRegressor())
    for r, rec in enumerate(fsdp):
        assert torch.equal(rec["built"], rank0 + r)  # what each rank built differed
        assert torch.equal(rec["initial"], rank0)  # what it trained from did not
    assert_close_runs(ddp, fsdp)


@pytest.mark.slow
def test_diloco_overlapped_with_two_optimizers_equals_ddp_inside(tmp_path):
    """DiLoCo with overlap_steps, manual optimization over two optimizers with momentum, the outer
    state on the CPU and the automatic policy: the trajectory is DDP inside's."""
    kwargs = {"sync_every": 4, "overlap_steps": 1, "outer_state_device": "cpu"}
    # manual optimization: max_steps counts both optimizers' steps, 8 batches
    ddp, fsdp = run_pair(tmp_path, "diloco", kwargs, max_steps=16, manual=True, momentum=0.9)
    assert_close_runs(ddp, fsdp)
    for rec in fsdp:
        # each optimizer's first round starts at its inner step 4 and lands one step later (the second, started
        # at the last step, lands at the strategy's end of training, after the recorder's)
        assert sorted((x["optimizer_index"], x["inner_step"]) for x in rec["reports"]) == [(0, 5), (1, 5)]
        assert len(rec["outer_states"]) == 2 and all(s["anchor_device"] == "cpu" for s in rec["outer_states"])
        # one per optimizer, no all-gather: two replicas on gloo, so each all-reduce is a pair exchange
        assert [name for name, *_ in rec["calls"][3]] == ["batch_isend_irecv", "batch_isend_irecv"]


@pytest.mark.slow
def test_gasloc_with_consensus_validation_and_spread_equals_ddp_inside(tmp_path):
    """The monitor's global diagnostics on sharded replicas: the consensus swapped in for validation
    and out again (the run goes on as DDP inside's), and the replicas' spread from local shards."""
    config = {"max_steps": 8, "val_check_interval": 4, "monitor": {"spread_every": 1, "consensus_validation": True}}
    ddp, fsdp = run_pair(tmp_path, "gasloc", {"sync_every": 2, "average_at_end": False}, **config)
    assert_close_runs(ddp, fsdp)
    for rec in fsdp:
        assert len(rec["before_validation"]) == 2
        for before, after in zip(rec["before_validation"], rec["after_validation"]):
            assert torch.equal(before, after)  # each rank's own shards back, bit for bit

    def spread(mode):
        rows = list(csv.DictReader(open(tmp_path / mode / "out" / "csv" / "version_0" / "metrics.csv")))
        return [float(r["outer/replica_spread"]) for r in rows if r.get("outer/replica_spread")]

    sharded, expected = spread("fsdp"), spread("ddp")
    assert len(sharded) == 4 and sharded == pytest.approx(expected, rel=1e-4)
    consensus = [torch.stack([fsdp[r]["weights"][2 * t + 1] for r in (0, 2)]) for t in range(4)]
    assert sharded == pytest.approx([(w - w.mean(0)).pow(2).sum(1).mean().sqrt().item() for w in consensus],
                                    rel=1e-4)


@pytest.mark.slow
def test_gasloc_with_int8_and_bf16_mixed_precision(tmp_path):
    """FSDP2's MixedPrecisionPolicy (bf16 compute, float32 reduction) under the automatic policy,
    GASLoC over int8 payloads with error feedback: it trains, the sharded parameters and the outer
    state stay float32, and each rank's payload is its own shards encoded."""
    recs = run(tmp_path, strategy="gasloc", devices=4, max_steps=8, start_method="popen", fsdp_bf16=True,
               strategy_kwargs={"sync_every": 4, "wire": {"format": "int8", "error_feedback": True}, **SHARDED})
    codec = make_codec("int8")
    for r, rec in enumerate(recs):
        assert rec["param_dtypes"] == ["torch.float32"]
        state = rec["outer_states"][0]
        assert state["anchor_dtype"] == "torch.float32" and state["numel"] == local_numels(r % 2)
        assert [x["bytes_sent"] for x in rec["reports"]] == [codec.nbytes(state["numel"])] * 2
        assert torch.isfinite(rec["weights"][-1]).all() and not torch.equal(rec["weights"][-1], rec["initial"])


@pytest.mark.slow
def test_exact_resume_from_a_sharded_checkpoint(tmp_path):
    """Saved mid inner phase, every rank writes its own shards; resumed, the run goes on bitwise as
    the straight one (inner momentum and outer state included). The main file's consensus model is
    full and loads on one CPU process, exported too."""
    k_save, steps = 6, 12  # an epoch ends at step 6 (the data loader resumes there), between outer steps 4 and 8
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": k_save, "save_top_k": -1}
    common = {"strategy": "noloco", "strategy_kwargs": {"sync_every": 4, **SHARDED}, "devices": 4,
              "max_steps": steps, "momentum": 0.9, "start_method": "popen"}
    straight = run(tmp_path / "straight", checkpoint=checkpoint, **common)
    middle = ckpts / f"step={k_save}.ckpt"
    files = sorted(os.path.basename(f) for f in glob.glob(str(ckpts / ".replicas" / f"step={k_save}.ckpt-*" / "*.pt")))
    assert files == [f"replica-0000{i}-shard-0000{j}.pt" for i in (0, 1) for j in (0, 1)]
    resumed = run(tmp_path / "resumed", ckpt_path=str(middle), **common)
    for r in range(4):
        for step, (a, b) in enumerate(zip(straight[r]["weights"][k_save:], resumed[r]["weights"])):
            assert torch.equal(a, b), (r, k_save + step)
        assert_same_tree(straight[r]["outer_states"], resumed[r]["outer_states"], "outer")
        assert_same_tree(straight[r]["optimizer_states"], resumed[r]["optimizer_states"], "inner")
    # the consensus model: the replicas' average at the save, whole, on one CPU process
    consensus = (straight[0]["weights"][k_save - 1] + straight[2]["weights"][k_save - 1]) / 2
    main = torch.load(middle, map_location="cpu", weights_only=True)
    assert main["optimizer_states"] == [] and main[checkpoints.META_KEY]["shards"] == 2
    model = tiny.TinyRegressor.load_from_checkpoint(middle, map_location="cpu")
    assert torch.allclose(tiny.flat(model), consensus, atol=1e-6)
    exported = checkpoints.export_consensus(middle, tmp_path / "export.ckpt")
    assert torch.equal(tiny.flat(tiny.TinyRegressor.load_from_checkpoint(exported)), tiny.flat(model))
    # resuming with DDP inside instead fails clearly, before training
    proc = run(tmp_path / "ddp", expect_failure=True, ckpt_path=str(middle),
               **{**common, "strategy_kwargs": {"sync_every": 4, "ranks_per_replica": 2}, "start_method": "fork"})
    assert "replica_sharding='fsdp' over 2 rank(s) per replica" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_replicas_that_shard_differently_fail_at_setup(tmp_path):
    run(tmp_path, expect_failure=True, strategy="noloco", strategy_kwargs={"sync_every": 3, **SHARDED},
               devices=4, max_steps=3, start_method="popen", model_parallel="mismatch")
    error = json.loads((tmp_path / "out" / "error0.json").read_text())
    assert error["type"] == "ValueError"
    assert "replica 0 and replica 1 shard the model differently" in error["message"]
    assert "body.weight" in error["message"]


def test_bad_sharding_arguments():
    from lightning_loco import ElasticConfig, FSDPConfig

    with pytest.raises(ValueError, match="replica_sharding must be None .*, 'fsdp' .* or an FSDPConfig"):
        lightning_loco.NoLoCoStrategy(replica_sharding="ddp")
    with pytest.raises(ValueError, match="FSDP blocks must be nn.Module classes or class names"):
        lightning_loco.NoLoCoStrategy(replica_sharding=FSDPConfig(blocks=(3,)))
    with pytest.raises(ValueError, match="FSDP kwargs must not hold 'mesh'"):
        lightning_loco.GASLoCStrategy(replica_sharding=FSDPConfig(kwargs={"mesh": None}))
    with pytest.raises(ValueError, match="Use start_method='popen'"):
        lightning_loco.NoLoCoStrategy(replica_sharding="fsdp", start_method="fork")
    # elastic replicas shard too (tests/test_elastic_sharded.py); what elastic mode refuses stays refused, saying why
    elastic = lightning_loco.NoLoCoStrategy(replica_sharding="fsdp", elastic=ElasticConfig("localhost:1"),
                                            ranks_per_replica=2)
    assert elastic.options.replica_sharding is not None and elastic.elastic is not None
    with pytest.raises(ValueError, match="start_method='popen'"):
        lightning_loco.NoLoCoStrategy(replica_sharding="fsdp", elastic=ElasticConfig("localhost:1"),
                                      start_method="fork")
    with pytest.raises(ValueError, match="a lossy wire format .* cannot yet undo on one rank alone"):
        lightning_loco.DiLoCoStrategy(replica_sharding="fsdp", elastic=ElasticConfig("localhost:1"),
                                      ranks_per_replica=2, wire="bfloat16")
    strategy = lightning_loco.DiLoCoStrategy(replica_sharding=FSDPConfig(blocks=("Linear",)), ranks_per_replica=2)
    assert strategy.options.replica_sharding.blocks == ("Linear",)


# ---------------------------------------------------------------- the pieces, in two plain gloo processes


def _pieces_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_loco.driver.flat import ShardedParameters
    from lightning_loco.replica import sharding

    init_gloo(rank, 2, port=port, timeout_s=30)
    try:
        mesh = sharding.replica_mesh("cpu", 2, "gloo", None).mesh
        assert mesh.mesh_dim_names == sharding.MESH_DIMS and mesh["data_parallel"].size() == 2
        torch.manual_seed(0)
        whole = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        fully_shard(model[0], mesh=mesh["data_parallel"])
        with pytest.raises(ValueError, match=r"2 parameter\(s\) are not sharded"):  # model[2]'s
            sharding.check_sharded(model, [0, 1])
        fully_shard(model, mesh=mesh["data_parallel"])
        sharding.check_sharded(model, [0, 1])
        with pytest.raises(ValueError, match="must stay inside the replica"):
            sharding.check_sharded(model, [0, 1, 2])
        # a full state dict (a plain Lightning checkpoint) loads shard by shard
        sharding.load_state_dict(model, whole.state_dict())
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        out = {"loaded": all(torch.equal(full[k], v) for k, v in whole.state_dict().items())}
        # so does a full optimizer state: it becomes DTensors like the parameters, and steps as the whole one
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7))
        adam = torch.optim.Adam(whole.parameters(), lr=0.1)
        whole(x).sum().backward()
        adam.step()
        sharded_adam = torch.optim.Adam(model.parameters(), lr=0.1)
        saved = copy.deepcopy(adam.state_dict())  # as a checkpoint holds it: no tensor shared with adam
        sharded_adam.load_state_dict(sharding.optimizer_state_to_shards(sharded_adam, saved))
        sharding.load_state_dict(model, whole.state_dict())
        for opt, m in ((adam, whole), (sharded_adam, model)):
            opt.zero_grad()
            m(x).sum().backward()  # every rank the same batch: FSDP's mean is the one batch's gradient
            opt.step()
        out["stepped"] = all(torch.allclose(v.full_tensor(), whole.state_dict()[k], atol=1e-6)
                             for k, v in model.state_dict().items())
        local = sharding.local_tree(sharded_adam.state_dict())
        out["local_state"] = all(not isinstance(t, DTensor) for s in local["state"].values() for t in s.values())
        # the flat vector of local shards: a forward without backward leaves the root unsharded; new values
        # written into the shards reach the next forward all the same
        flat = ShardedParameters(list(model.parameters()), "cpu", after_scatter=lambda: sharding.reshard(model))
        out["numel"] = flat.numel
        with torch.no_grad():
            model(x)
            flat.scatter(torch.zeros(flat.numel))
            out["after_scatter"] = model(x).abs().max().item()
        dist.barrier()
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharding_pieces_in_two_processes(tmp_path):
    start_ranks(_pieces_worker, 2, args=(free_port(), str(tmp_path)), start_method="spawn")
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    whole = sum(p.numel() for p in nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).parameters())
    assert sum(x["numel"] for x in res) == whole
    for x in res:
        assert x["loaded"] and x["stepped"] and x["local_state"]
        assert x["after_scatter"] == 0.0  # zero weights, zero output: the new shards were gathered


def test_gpu_sharded_dry_run(tmp_path):
    """benchmarks/gpu_sharded.py on the CPU: a mesh of one shard, the staging path, a checkpoint."""
    env = {**os.environ, "LOCO_BENCH_RESULTS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_sharded"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_sharded.json").read_text())
    assert result["device"] == "cpu" and result["ok"], result


@pytest.mark.slow
def test_sharded_memory_benchmark_quick(tmp_path):
    """The memory benchmark's quick mode: each rank's parameters, inner optimizer and outer state are
    within 1.15/k of DDP inside's, and each rank sends 1/k of the model (tracked bytes, not time)."""
    env = {**os.environ, "LOCO_BENCH_RESULTS": str(tmp_path), "PYTHONPATH": str(ROOT), "LOCO_BENCH_FORK_WORKERS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sharded_memory", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "sharded_memory.json").read_text())["rows"]
    assert [(r["mode"], r["ranks_per_replica"]) for r in rows] == [("ddp", 2), ("fsdp", 2)]  # k = 4: the full run
    model_mb = 4 * rows[0]["m_params"]
    for row in rows[1::2]:
        k = row["ranks_per_replica"]
        assert row["state_vs_ddp"] <= 1.15 / k and row["met"]
        assert row["mb_sent_per_rank"] == pytest.approx(model_mb / k, rel=1e-6)


class _ViewEnds(nn.Module):
    """A module whose first child is a block ending in a view (Flatten), as a CNN's feature extractor is."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Unflatten(1, (2, 3)), nn.Flatten())
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _view_worker(rank: int, port: int, out_dir: str) -> None:
    import warnings

    from lightning_loco.replica import sharding
    from lightning_loco.replica.options import FSDPConfig

    init_gloo(rank, 2, port=port, timeout_s=30)
    try:
        mesh = sharding.replica_mesh("cpu", 2, "gloo", None).mesh
        torch.manual_seed(0)
        model, whole = _ViewEnds(), _ViewEnds()
        whole.load_state_dict(model.state_dict())
        sharding.auto_shard(model, mesh["data_parallel"], FSDPConfig())
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).sum().backward()
        whole(x).sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out = {"warnings": [str(w.message) for w in caught],
               "grads": all(torch.allclose(grads[n], p.grad, atol=1e-6) for n, p in whole.named_parameters())}
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_automatic_policy_never_hooks_a_view_so_no_gradient_is_lost(tmp_path):
    """A direct child that is an nn.Sequential ending in a view (Flatten) would make FSDP2 warn that it "will
    silently drop the pre-backward hook": the automatic policy shards a Sequential's parameter-holding layers
    instead, whose outputs are new tensors. No such warning, and the gradients are the unsharded module's."""
    start_ranks(_view_worker, 2, args=(free_port(), str(tmp_path)), start_method="spawn")
    for r in range(2):
        out = torch.load(tmp_path / f"{r}.pt")
        assert not [w for w in out["warnings"] if "view" in w], out["warnings"]
        assert out["grads"]
