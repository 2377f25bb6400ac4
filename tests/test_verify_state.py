"""VerifyState: digests of the state that must agree (lightning_loco.replica.state_digest), compared after every
DiLoCo round and on resume, with real processes; a difference names the replica, the tensor and the step."""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_loco import VerifyState
from lightning_loco.replica import state_digest
from lightning_loco.replica.state_digest import digest, digests, first_difference
from lightning_loco.testing.launch import free_port, start_ranks
from lightning_loco.trainer.verify import KEY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool])
def test_a_digest_sees_one_bit_and_a_swap_of_two_elements(dtype):
    t = (torch.arange(12) % 2 == 0) if dtype == torch.bool else torch.arange(12).to(dtype).reshape(3, 4)
    assert digest(t) == digest(t.clone())
    flipped = t.clone()
    flipped.view(-1)[5] = not flipped.view(-1)[5] if dtype == torch.bool else flipped.view(-1)[5] + 1
    assert digest(flipped) != digest(t)
    swapped = t.clone().view(-1)
    swapped[[2, 3]] = swapped[[3, 2]]
    assert digest(swapped) != digest(t)
    assert digest(t.t()) != digest(t) or dtype == torch.bool  # the bytes in order, not the values as a set


def signed64(n: int) -> int:
    return (n + 2**63) % 2**64 - 2**63


@pytest.mark.parametrize("chunk", [7, 2**18], ids=["many-chunks", "one-chunk"])
def test_a_digest_taken_in_chunks_is_the_whole_tensors(monkeypatch, chunk):
    """digest takes CHUNK_WORDS words at a time (its temporaries that small); its numbers are the whole tensor's
    (the sum of the words and of each word times its position from 1, modulo 2**64, here in Python's integers),
    also with the scratch reused across the tensors of one pass (digests)."""
    monkeypatch.setattr(state_digest, "CHUNK_WORDS", chunk)
    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randint(-2**62, 2**62, (1000,), generator=g, dtype=torch.int64),  # the sums wrap
               "f": torch.randn(300, 7, generator=g).t(), "h": torch.randn(50, generator=g).to(torch.bfloat16),
               "b": torch.rand(33, generator=g) > 0.5, "one": torch.tensor(3.5), "none": torch.zeros(0, 3)}
    words = {torch.int64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.bool: torch.bool}
    for name, t in tensors.items():
        w = t.contiguous().reshape(-1).view(words[t.dtype]).tolist()
        want = (signed64(sum(w)), signed64(sum(int(x) * (i + 1) for i, x in enumerate(w))))
        assert digest(t) == want, name
    assert digests(tensors.items()) == {name: digest(t) for name, t in tensors.items()}


def test_first_difference_names_the_first_tensor_that_differs_or_is_missing():
    a = {"x": (1, 2), "y": (3, 4)}
    assert first_difference(a, dict(a)) is None
    assert first_difference(a, {"x": (1, 2), "y": (3, 5)}) == "y"
    assert first_difference(a, {"x": (1, 2)}) == "y"
    assert first_difference(a, {**a, "z": (0, 0)}) == "z"
    assert digests([("w", torch.ones(2)), ("n", 3)]) == {"w": digest(torch.ones(2))}


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class NudgeReplicaOne(Callback):
    """Replica 1 leaves a round with a bias of its own (what a replica that missed a round would hold)."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 4:
            with torch.no_grad():
                pl_module.layer.bias.add_(1e-6)


def _fit(rank: int, out: str, callbacks: list[Any], max_steps: int, ckpt_path: Any = None) -> dict[str, Any]:
    from lightning_loco import DiLoCoStrategy

    g = torch.Generator().manual_seed(rank)
    data = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=2)
    strategy = DiLoCoStrategy(sync_every=2, timeout=timedelta(seconds=60))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=callbacks, default_root_dir=out)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Tiny(), train_dataloaders=data, ckpt_path=ckpt_path)
        return {"error": None, "step": trainer.global_step}
    except Exception as err:  # noqa: BLE001  # what each rank saw, for the test to judge
        return {"error": type(err).__name__, "message": str(err), "step": trainer.global_step}


def _rank(rank: int, port: int, out: str, case: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE="2")
    results = []
    if case == "rounds":
        results.append(_fit(rank, out, [VerifyState(rounds=True)], max_steps=6))  # agree: passes
        results.append(_fit(rank, out, [NudgeReplicaOne(), VerifyState()], max_steps=6))
    else:
        save = ModelCheckpoint(dirpath=out, filename="save-{step}", every_n_train_steps=2, save_top_k=-1)
        results.append(_fit(rank, out, [save, VerifyState()], max_steps=4))
        path = str(Path(out, "save-step=4.ckpt"))
        results.append(_fit(rank, out, [VerifyState()], max_steps=6, ckpt_path=path))  # resumes what it saved
        dist.barrier()
        if rank == 0:  # the checkpoint's digest of replica 1's weight no longer matches its file
            main = torch.load(path, weights_only=False)
            main[KEY]["ranks"][1]["layer.weight"] = (0, 0)
            torch.save(main, path)
        dist.barrier()
        results.append(_fit(rank, out, [VerifyState()], max_steps=6, ckpt_path=path))
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    os._exit(0)


def run_case(tmp_path: Path, case: str) -> dict[int, list[dict[str, Any]]]:
    start_ranks(_rank, 2, args=(free_port(), str(tmp_path), case), timeout_s=180)
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}


def test_diloco_replicas_are_checked_after_every_round_and_a_difference_is_named(tmp_path):
    results = run_case(tmp_path, "rounds")
    for rank in range(2):
        agreeing, nudged = results[rank]
        assert agreeing == {"error": None, "step": 6}
        assert nudged["error"] == "StateMismatchError", nudged
        assert nudged["message"].startswith("Replica 1 (rank 1) holds weights after outer step 1 that differ from "
                                            "replica 0's at step 4: tensor 'layer.bias' is not the same")


def test_a_resumed_fit_is_checked_against_the_digests_saved_in_its_checkpoint(tmp_path):
    results = run_case(tmp_path, "resume")
    for rank in range(2):
        first, resumed, _ = results[rank]
        assert first == {"error": None, "step": 4} and resumed == {"error": None, "step": 6}
    tampered = results[1][2]
    assert tampered["error"] == "StateMismatchError", tampered
    assert tampered["message"].startswith("Replica 1 (rank 1) resumed with state that differs from the checkpoint "
                                          "saved at step 4: tensor 'layer.weight' is not what was saved")
    peer = results[0][2]  # replica 0 hears of it as fit starts, not at the process-group timeout
    assert peer["error"] == "PeerError", peer
    assert peer["message"].startswith("Replica 1 (rank 1) failed as fit started (StateMismatchError: Replica 1")


@pytest.mark.slow
def test_the_cost_benchmark_runs_quick(tmp_path):
    from lightning_loco.testing.launch import run_module_forked

    root = Path(__file__).parent.parent
    proc = run_module_forked("benchmarks.verify_state", ["--quick"], tmp_path / "bench-output",
                             {"LOCO_BENCH_RESULTS": str(tmp_path)}, 300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "verify_state.json").read_text())["rows"]
    assert [(r["params"], r["replicas"]) for r in rows] == [(100_000, 2)]
    assert rows[0]["digest"]["min"] <= rows[0]["digest"]["median"] and "check / all-reduce" in proc.stdout
