"""The shipped NoLoCo job runs no global collective per outer step.

The example config is run through the ``lightning-loco`` command (2 CPU replicas, a few steps) with
every ``torch.distributed`` call counted in each process: global collectives (all-reduce,
broadcast, barrier, all-gather, ... over all ranks) must not grow with the number of outer steps;
point-to-point exchanges do.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_loco.testing.launch import free_port

ROOT = Path(__file__).parent.parent
CONFIG = ROOT / "examples" / "shakespeare" / "noloco.yaml"

# Runs the command with torch.distributed wrapped by counters. Lightning's popen launcher re-runs
# this script in every child process, so every rank counts its own calls and writes them at exit.
COUNTING_SCRIPT = textwrap.dedent(
    """
    import atexit, collections, functools, inspect, json, os, sys
    import torch.distributed as dist

    COLLECTIVES = (
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
        "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather",
        "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    )
    POINT_TO_POINT = ("send", "recv", "batch_isend_irecv")  # P2POp accepts only the original isend/irecv
    counts = collections.Counter()

    def kind(name, original, args, kwargs):
        if name in POINT_TO_POINT:
            return "p2p"
        try:
            group = inspect.signature(original).bind(*args, **kwargs).arguments.get("group")
        except TypeError:
            group = None
        if group is None or group is dist.group.WORLD or dist.get_world_size(group) == dist.get_world_size():
            return "global"
        return "subgroup"

    def wrap(name, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            counts[kind(name, original, args, kwargs) + ":" + name] += 1
            return original(*args, **kwargs)
        return counted

    for name in COLLECTIVES + POINT_TO_POINT:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))

    def write():
        path = os.path.join(os.environ["COUNT_DIR"], "rank" + os.environ.get("LOCAL_RANK", "0") + ".json")
        with open(path, "w") as f:
            json.dump(counts, f)

    atexit.register(write)
    from lightning_loco.cli import main
    main()
    """
)


def count_calls(tmp_path: Path, outer_steps: int, sync_every: int = 2) -> list[dict[str, int]]:
    steps = outer_steps * sync_every
    run_dir = tmp_path / f"outer{outer_steps}"
    run_dir.mkdir()
    script = run_dir / "counting_cli.py"
    script.write_text(COUNTING_SCRIPT)
    args = [
        "fit", "--config", str(CONFIG), "--trainer.devices=2", f"--trainer.max_steps={steps}",
        f"--model.init_args.max_steps={steps}", "--model.init_args.warmup_steps=1",
        f"--trainer.strategy.init_args.sync_every={sync_every}",
        f"--trainer.val_check_interval={steps}",  # one validation (and checkpoint) at the end, whatever the length
        "--trainer.limit_val_batches=2", "--data.init_args.batch_size=4",
        f"--trainer.logger.init_args.save_dir={run_dir}", "--trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, "COUNT_DIR": str(run_dir), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]


def total(counts: dict[str, int], kind: str) -> int:
    return sum(n for key, n in counts.items() if key.startswith(kind + ":"))


@pytest.mark.slow
def test_shipped_noloco_job_has_no_global_collective_per_outer_step(tmp_path):
    short, long = count_calls(tmp_path, outer_steps=2), count_calls(tmp_path, outer_steps=6)
    for rank in range(2):
        # Lightning's setup, validation and checkpoint collectives, the same whatever the length
        assert total(short[rank], "global") > 0, short[rank]
        assert {k: n for k, n in long[rank].items() if k.startswith("global:")} == {
            k: n for k, n in short[rank].items() if k.startswith("global:")
        }, (short[rank], long[rank])
        # one pair exchange per outer step: the only thing that grows
        assert long[rank]["p2p:batch_isend_irecv"] - short[rank]["p2p:batch_isend_irecv"] == 4
