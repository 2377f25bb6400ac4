"""Checkpoints that keep every replica: exact resume, the consensus model, and bad input.

Runs are real multi-process Trainers (``tests/tiny.py``). For exact resume the checkpoint falls in the
middle of an inner phase (H = 4, saved after step 6) and at the end of a data epoch: Lightning restarts
a non-resumable DataLoader at the start of its epoch, so only epoch-end checkpoints resume the data
stream exactly (a resumable DataLoader lifts that; it is Lightning's rule, not ours).
"""

import glob
import os
import shutil

import pytest
import torch

from lightning_loco.replica.checkpoints import (
    CheckpointError,
    check_replica_files,
    export_consensus,
    main_meta,
    newer_complete_checkpoint,
    read_replica,
    remove_sidecars,
    replica_file,
    sidecar_dir,
    storage,
    write_manifest,
    write_replica,
)

import tiny

H, K = 4, 6


def assert_same_tree(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("algorithm", ["noloco", "diloco", "gasloc"])
@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_exact_resume_from_the_middle_of_an_inner_phase(tmp_path, algorithm, devices):
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": K, "save_top_k": -1,
                  "save_last": "link"}
    common = {"strategy": algorithm, "strategy_kwargs": {"sync_every": H}, "devices": devices, "max_steps": 2 * K}
    straight = tiny.launch(tmp_path / "straight", checkpoint=checkpoint, **common)
    middle = ckpts / f"step={K}.ckpt"
    resumed = tiny.launch(tmp_path / "resumed", ckpt_path=str(middle), **common)

    for r in range(devices):
        # every replica's weights after each resumed step, bitwise
        assert len(resumed[r]["weights"]) == K
        for step, (a, b) in enumerate(zip(straight[r]["weights"][K:], resumed[r]["weights"])):
            assert torch.equal(a, b), (r, K + step)
        # outer state, counters (hence the peer schedule) and inner optimizer state, tensor by tensor
        assert_same_tree(straight[r]["outer_states"], resumed[r]["outer_states"], "outer")
        assert_same_tree(straight[r]["optimizer_states"], resumed[r]["optimizer_states"], "optimizer")
    if algorithm != "diloco":
        assert not torch.equal(straight[0]["weights"][K - 1], straight[1]["weights"][K - 1])

    # the main file is the consensus: the replicas' average at the save
    average = sum(rec["weights"][K - 1] for rec in straight) / devices
    assert torch.allclose(tiny.flat(tiny.TinyRegressor.load_from_checkpoint(middle)), average, atol=1e-6)
    # replica files hold tensors and plain values only
    files = sorted(glob.glob(str(ckpts / ".replicas" / f"step={K}.ckpt-*" / "replica-*.pt")))
    assert len(files) == devices
    for f in files:
        torch.load(f, weights_only=True)
    # save_last="link": last.ckpt links to the newest checkpoint and loads through the link
    assert os.path.islink(ckpts / "last.ckpt")
    assert os.path.realpath(ckpts / "last.ckpt") == os.path.realpath(ckpts / f"step={2 * K}.ckpt")
    tiny.TinyRegressor.load_from_checkpoint(ckpts / "last.ckpt")


@pytest.mark.slow
def test_export_writes_a_plain_consensus_model(tmp_path):
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": H, "average_at_end": False},
                       devices=2, max_steps=K, save_to=str(tmp_path / "run.ckpt"))
    average = (recs[0]["weights"][-1] + recs[1]["weights"][-1]) / 2
    plain = export_consensus(tmp_path / "run.ckpt", tmp_path / "plain.ckpt")
    assert "lightning_loco" not in torch.load(plain, weights_only=True)  # no training state, no replica files
    assert torch.allclose(tiny.flat(tiny.TinyRegressor.load_from_checkpoint(plain)), average, atol=1e-6)
    state_dict = torch.load(export_consensus(tmp_path / "run.ckpt", tmp_path / "sd.pt", state_dict_only=True),
                            weights_only=True)
    module = tiny.TinyRegressor()
    module.load_state_dict(state_dict)
    assert torch.allclose(tiny.flat(module), average, atol=1e-6)


@pytest.mark.slow
def test_average_at_end_leaves_the_consensus_in_memory(tmp_path):
    recs = tiny.launch(tmp_path, strategy="gasloc", strategy_kwargs={"sync_every": H}, devices=2, max_steps=K,
                       save_to=str(tmp_path / "end.ckpt"))
    average = (recs[0]["weights"][-1] + recs[1]["weights"][-1]) / 2
    for r in range(2):  # after fit every replica holds the average
        saved = torch.load(glob.glob(str(tmp_path / ".replicas" / "end.ckpt-*" / f"replica-0000{r}.pt"))[0],
                           weights_only=True)
        module = tiny.TinyRegressor()
        module.load_state_dict(saved["state_dict"])
        assert torch.allclose(tiny.flat(module), average, atol=1e-6)


@pytest.mark.slow
def test_save_top_k_removes_old_checkpoints_with_their_replicas_and_a_new_world_size_starts_from_consensus(
    tmp_path,
):
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": 2, "save_top_k": 1,
                  "save_last": "link"}
    recs = tiny.launch(tmp_path / "a", strategy="noloco", strategy_kwargs={"sync_every": 3}, devices=2,
                       max_steps=8, checkpoint=checkpoint)
    assert sorted(os.listdir(ckpts)) == [".replicas", "last.ckpt", "step=8.ckpt"]
    sidecars = os.listdir(ckpts / ".replicas")
    assert len(sidecars) == 1 and sidecars[0].startswith("step=8.ckpt-")  # older replica folders removed

    # resume "last" with 4 replicas instead of 2: a warning, and every replica starts from the consensus
    resumed = tiny.launch(tmp_path / "b", strategy="noloco", strategy_kwargs={"sync_every": 3}, devices=4,
                          max_steps=10, checkpoint=checkpoint, ckpt_path="last")
    assert "holds 2 replicas but this run has 4" in resumed[0]["stderr"]
    consensus = (recs[0]["weights"][-1] + recs[1]["weights"][-1]) / 2
    for rec in resumed:
        assert torch.allclose(rec["starts"][0], consensus, atol=1e-6)
        assert rec["outer_states"][0]["inner_steps"] == 2  # fresh outer state: counted from the resume


@pytest.mark.slow
def test_a_ddp_checkpoint_starts_a_noloco_run(tmp_path):
    ddp = tiny.launch(tmp_path / "ddp", strategy="ddp", devices=2, max_steps=4, save_to=str(tmp_path / "ddp.ckpt"))
    recs = tiny.launch(tmp_path / "noloco", strategy="noloco", strategy_kwargs={"sync_every": H}, devices=2,
                       max_steps=8, ckpt_path=str(tmp_path / "ddp.ckpt"))
    for rec in recs:
        assert torch.equal(rec["starts"][0], ddp[0]["weights"][-1])  # all replicas load the plain checkpoint
        assert rec["outer_states"][0]["inner_steps"] == 4 and rec["outer_states"][0]["outer_steps"] == 1


@pytest.mark.slow
def test_missing_replica_file_or_other_algorithm_fails_clearly_and_deletes_nothing(tmp_path):
    path = tmp_path / "run.ckpt"
    tiny.launch(tmp_path / "a", strategy="noloco", strategy_kwargs={"sync_every": H}, devices=2, max_steps=4,
                save_to=str(path))
    (replica0, replica1) = sorted(glob.glob(str(tmp_path / ".replicas" / "run.ckpt-*" / "replica-*.pt")))
    os.remove(replica1)
    before = sorted(str(p) for p in tmp_path.rglob("*") if p.is_file() and "out" not in p.parts)
    proc = tiny.launch(tmp_path / "b", expect_failure=True, strategy="noloco", strategy_kwargs={"sync_every": H},
                       devices=2, max_steps=8, ckpt_path=str(path))
    assert "replica file(s) missing" in proc.stderr and replica1 in proc.stderr
    after = sorted(str(p) for p in tmp_path.rglob("*") if p.is_file() and "out" not in p.parts)
    assert before == after  # nothing overwritten or deleted

    proc = tiny.launch(tmp_path / "c", expect_failure=True, strategy="diloco", strategy_kwargs={"sync_every": H},
                       devices=2, max_steps=8, ckpt_path=str(path))
    assert "was written by 'noloco'" in proc.stderr


@pytest.mark.slow
def test_an_interrupted_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "run.ckpt"
    recs = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": H, "average_at_end": False},
                       devices=2, max_steps=4, save_to=str(path), interrupted_save_to=str(path))
    folders = sorted(glob.glob(str(tmp_path / ".replicas" / "run.ckpt-*")))
    assert len(folders) == 2  # the complete save's and the interrupted save's orphan
    main = torch.load(path, weights_only=True)
    for r in range(2):
        payload = read_replica(str(path), main["lightning_loco"], r)  # the main file points to the complete save
        module = tiny.TinyRegressor()
        module.load_state_dict(payload["state_dict"])
        assert torch.equal(tiny.flat(module), recs[r]["weights"][-1])  # not the interrupted save's weights + 1
    remove_sidecars(str(path), keep=os.path.join(tmp_path, main["lightning_loco"]["replicas"]))
    assert len(glob.glob(str(tmp_path / ".replicas" / "run.ckpt-*"))) == 1  # what the next save cleans up


def test_replica_file_errors_name_the_file(tmp_path):
    meta = {"save_id": "abc", "num_replicas": 2, "replicas": ".replicas/x.ckpt-abc"}
    main = str(tmp_path / "x.ckpt")
    sidecar = tmp_path / ".replicas" / "x.ckpt-abc"
    with pytest.raises(CheckpointError, match="replica-00000.pt"):
        check_replica_files(main, meta)
    write_replica(str(sidecar), 0, {"save_id": "abc", "replica": 0})
    write_replica(str(sidecar), 1, {"save_id": "other", "replica": 1})
    check_replica_files(main, meta)
    assert read_replica(main, meta, 0)["replica"] == 0
    with pytest.raises(CheckpointError, match="another save"):
        read_replica(main, meta, 1)
    (sidecar / "replica-00001.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="unreadable.*replica-00001.pt"):
        read_replica(main, meta, 1)
    assert not list(sidecar.glob("*.partial"))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,merge", [("noloco", "predict_correct"), ("gasloc", "predict_correct"),
                                             ("diloco", "delayed")])
def test_exact_resume_from_a_checkpoint_taken_while_a_round_is_in_flight(tmp_path, algorithm, merge):
    # H = 4, τ = 3: the round that starts after step 4 lands after step 7, so the save after step 6
    # happens with the round in flight. The replica files keep the received sum and the prediction.
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": K, "save_top_k": -1}
    kwargs = {"sync_every": H, "overlap_steps": 3, "overlap_merge": merge}
    common = {"strategy": algorithm, "strategy_kwargs": kwargs, "devices": 2, "max_steps": 2 * K}
    straight = tiny.launch(tmp_path / "straight", checkpoint=checkpoint, **common)
    middle = ckpts / f"step={K}.ckpt"
    (sidecar,) = glob.glob(str(ckpts / ".replicas" / f"step={K}.ckpt-*"))
    saved = torch.load(os.path.join(sidecar, "replica-00000.pt"), weights_only=True)
    flight = saved["outer"][0]["in_flight"]
    assert (flight["outer_step"], flight["start_step"], flight["land_step"], flight["merge"]) == (0, H, H + 3, merge)
    resumed = tiny.launch(tmp_path / "resumed", ckpt_path=str(middle), **common)
    for r in range(2):
        for step, (a, b) in enumerate(zip(straight[r]["weights"][K:], resumed[r]["weights"])):
            assert torch.equal(a, b), (r, K + step)
        assert_same_tree(straight[r]["outer_states"], resumed[r]["outer_states"], "outer")
        assert_same_tree(straight[r]["optimizer_states"], resumed[r]["optimizer_states"], "optimizer")


def test_last_after_an_interrupted_save_resumes_from_the_newest_complete_checkpoint(tmp_path):
    # ModelCheckpoint writes step=12.ckpt, then last.ckpt. Here the run stopped while last.ckpt was being
    # written at step 12: step=12.ckpt is complete, last.ckpt is still the one written at step 6, and the
    # interrupted save left a replica folder without its manifest.
    ckpts = tmp_path / "ckpts"
    checkpoint = {"dirpath": str(ckpts), "filename": "{step}", "every_n_train_steps": K, "save_top_k": -1,
                  "save_last": True}
    common = {"strategy": "noloco", "strategy_kwargs": {"sync_every": H}, "devices": 2, "max_steps": 3 * K}
    straight = tiny.launch(tmp_path / "straight", checkpoint=checkpoint, **common)

    def folder(name):
        (path,) = glob.glob(str(ckpts / ".replicas" / f"{name}-*"))
        return path

    shutil.rmtree(folder(f"step={3 * K}.ckpt"))  # the run never got to step 18
    os.remove(ckpts / f"step={3 * K}.ckpt")
    interrupted = folder("last.ckpt")  # last.ckpt's save at step 12: one replica file written, no manifest
    shutil.rmtree(interrupted)
    os.makedirs(interrupted)
    shutil.copy(os.path.join(folder(f"step={2 * K}.ckpt"), "replica-00000.pt"), interrupted)
    # last.ckpt as ModelCheckpoint wrote it at step 6: the step-6 save under the name last.ckpt
    old = folder(f"step={K}.ckpt")
    shutil.copytree(old, ckpts / ".replicas" / ("last.ckpt-" + old.rsplit("-", 1)[1]))
    main = torch.load(ckpts / f"step={K}.ckpt", weights_only=False)
    main["lightning_loco"]["replicas"] = ".replicas/last.ckpt-" + old.rsplit("-", 1)[1]
    torch.save(main, ckpts / "last.ckpt")
    written = os.stat(ckpts / f"step={K}.ckpt").st_mtime_ns
    os.utime(ckpts / "last.ckpt", ns=(written, written))

    resumed = tiny.launch(tmp_path / "resumed", checkpoint=checkpoint, ckpt_path="last", **common)
    for r in range(2):
        assert len(resumed[r]["weights"]) == K  # from step 12, not from step 6
        for step, (a, b) in enumerate(zip(straight[r]["weights"][2 * K:], resumed[r]["weights"])):
            assert torch.equal(a, b), (r, 2 * K + step)
        assert_same_tree(straight[r]["outer_states"], resumed[r]["outer_states"], "outer")
    assert "holds global step 6" in resumed[0]["stderr"] and f"step={2 * K}.ckpt" in resumed[0]["stderr"]


def _main_file(path, save_id, num_replicas, step):
    """A main file of ours at ``path`` (a path or URL) with complete replica files and manifest."""
    fs, inner = storage(path)
    meta = main_meta(path, save_id, "noloco", num_replicas)
    folder = sidecar_dir(path, save_id)
    for k in range(num_replicas):
        write_replica(folder, k, {"save_id": save_id, "replica": k, "state_dict": {"w": torch.full((2,), float(k))}})
    checkpoint = {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((2,), 0.5)}, "lightning_loco": meta}
    write_manifest(folder, path, checkpoint, meta)
    with fs.open(inner, "wb") as f:
        torch.save(checkpoint, f)
    return folder


def test_newer_complete_checkpoint_skips_incomplete_saves_and_older_files(tmp_path):
    ckpts = tmp_path / "ckpts"
    _main_file(ckpts / "step=4.ckpt", "aaa", 2, 4)  # older than last.ckpt: from an earlier run
    _main_file(ckpts / "last.ckpt", "bbb", 2, 2)
    for name in ("step=4.ckpt", "last.ckpt"):  # written at whole seconds, one apart
        os.utime(ckpts / name, (1000 if name == "step=4.ckpt" else 1001,) * 2)
    assert newer_complete_checkpoint(ckpts / "last.ckpt", 2) is None
    folder = _main_file(ckpts / "step=6.ckpt", "ccc", 2, 6)
    os.remove(replica_file(folder, 1))  # a replica file missing: not complete
    assert newer_complete_checkpoint(ckpts / "last.ckpt", 2) is None
    folder = _main_file(ckpts / "step=8.ckpt", "ddd", 2, 8)
    os.remove(os.path.join(folder, "save.json"))  # no manifest: the save did not complete
    assert newer_complete_checkpoint(ckpts / "last.ckpt", 2) is None
    _main_file(ckpts / "step=10.ckpt", "eee", 2, 10)
    os.remove(ckpts / "step=10.ckpt")  # the main file was never written
    assert newer_complete_checkpoint(ckpts / "last.ckpt", 2) is None
    _main_file(ckpts / "step=12.ckpt", "fff", 2, 12)
    assert newer_complete_checkpoint(ckpts / "last.ckpt", 2) == (str(ckpts / "step=12.ckpt"), 12)
    assert newer_complete_checkpoint(ckpts / "last.ckpt", 12) is None  # last.ckpt is as far along


def test_replica_files_on_remote_storage(tmp_path):
    # fsspec's in-memory filesystem: nothing of it exists on disk, so any plain file operation would fail
    root = f"memory://{tmp_path.name}/ckpts"
    folder = _main_file(f"{root}/run.ckpt", "abc", 2, 5)
    assert folder == f"memory:///{tmp_path.name}/ckpts/.replicas/run.ckpt-abc"
    assert not os.path.exists("memory:") and not os.path.exists(f"/{tmp_path.name}")
    meta = {"save_id": "abc", "num_replicas": 2, "replicas": ".replicas/run.ckpt-abc"}
    check_replica_files(f"{root}/run.ckpt", meta)
    assert torch.equal(read_replica(f"{root}/run.ckpt", meta, 1)["state_dict"]["w"], torch.ones(2))
    assert newer_complete_checkpoint(f"{root}/last.ckpt", 2) is None  # no such file
    _main_file(f"{root}/last.ckpt", "old", 2, 2)
    _main_file(f"{root}/step=7.ckpt", "new", 2, 7)
    assert newer_complete_checkpoint(f"{root}/last.ckpt", 2) == (f"memory:///{tmp_path.name}/ckpts/step=7.ckpt", 7)
    # export to remote storage
    out = export_consensus(f"{root}/run.ckpt", f"{root}/export/plain.ckpt")
    fs, inner = storage(out)
    with fs.open(inner, "rb") as f:
        assert torch.equal(torch.load(f, weights_only=True)["state_dict"]["w"], torch.full((2,), 0.5))
    # a missing replica file is named by its URL; removing the checkpoint's replica folders works there too
    fs.rm(storage(replica_file(folder, 0))[1])
    with pytest.raises(CheckpointError, match=r"memory:///.*run\.ckpt-abc/replica-00000\.pt"):
        check_replica_files(f"{root}/run.ckpt", meta)
    remove_sidecars(f"{root}/run.ckpt")
    assert not fs.exists(storage(folder)[1])
    assert fs.exists(storage(sidecar_dir(f"{root}/last.ckpt", "old"))[1])  # other checkpoints' folders stay
    fs.rm(f"/{tmp_path.name}", recursive=True)


def test_exact_resume_through_a_file_url(tmp_path):
    # saved with trainer.save_checkpoint after step 6, as ModelCheckpoint does (whose dirpath itself takes
    # no file:// URL: Lightning makes it a relative path)
    url = f"file://{tmp_path}/ckpts/step={K}.ckpt"
    common = {"strategy": "gasloc", "strategy_kwargs": {"sync_every": H}, "devices": 2, "max_steps": 2 * K}
    straight = tiny.launch(tmp_path / "straight", save_at_step=[K, url], **common)
    assert len(glob.glob(str(tmp_path / "ckpts" / ".replicas" / f"step={K}.ckpt-*" / "replica-*.pt"))) == 2
    resumed = tiny.launch(tmp_path / "resumed", ckpt_path=url, **common)
    for r in range(2):
        assert len(resumed[r]["weights"]) == K
        for step, (a, b) in enumerate(zip(straight[r]["weights"][K:], resumed[r]["weights"])):
            assert torch.equal(a, b), (r, K + step)
        assert_same_tree(straight[r]["outer_states"], resumed[r]["outer_states"], "outer")
        assert_same_tree(straight[r]["optimizer_states"], resumed[r]["optimizer_states"], "optimizer")


def test_exact_resume_from_in_memory_storage(tmp_path):
    # memory:// lives in one process: one replica, and the resumed run in the same process (tiny's then_resume).
    # 48 samples in batches of 4 make an epoch of 12 steps; the checkpoint falls at its end.
    ckpts = f"memory://{tmp_path.name}/ckpts"
    checkpoint = {"dirpath": ckpts, "filename": "{step}", "every_n_train_steps": 12, "save_top_k": -1}
    (straight,) = tiny.launch(tmp_path, strategy="noloco", strategy_kwargs={"sync_every": H}, devices=1,
                              max_steps=24, checkpoint=checkpoint, then_resume=f"{ckpts}/step=12.ckpt")
    resumed = torch.load(tmp_path / "out" / "resumed" / "rank0.pt")
    assert len(resumed["weights"]) == 12
    for step, (a, b) in enumerate(zip(straight["weights"][12:], resumed["weights"])):
        assert torch.equal(a, b), 12 + step
    assert_same_tree(straight["outer_states"], resumed["outer_states"], "outer")
    assert_same_tree(straight["optimizer_states"], resumed["optimizer_states"], "optimizer")
    assert not (tmp_path / "ckpts").exists() and not os.path.exists("memory:")
