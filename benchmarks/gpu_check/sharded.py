"""Part 6, FSDP2 inside a replica on one GPU: a mesh of one shard (``replica_sharding="fsdp"``) runs the
DTensor path, the staging of CUDA shards into a CPU outer state, a full consensus model in the
checkpoint and a sharded resume (:func:`benchmarks.gpu_sharded.check`). The dry run takes the same
path on the CPU, with CPU tensors sent through the staging buffers as CUDA ones would be."""

from __future__ import annotations

import tempfile
from typing import Any

from benchmarks.gpu_check.settings import Budget, Setting, say


def part_sharded(setting: Setting, budget: Budget) -> dict[str, Any]:
    import torch

    from benchmarks import gpu_sharded
    from lightning_loco.driver.flat import FlatParameters
    from lightning_loco.transport import TorchDistributedTransport

    cuda = torch.cuda.is_available()
    sizes = {} if cuda else {"width": 64, "depth": 2}
    saved = FlatParameters.stage_cpu_params, TorchDistributedTransport.stage_cpu_payloads
    try:  # the dry run sets both class switches: they must not outlive the part
        with tempfile.TemporaryDirectory() as out_dir:
            out = gpu_sharded.check("cuda" if cuda else "cpu", out_dir, steps=8, **sizes)
    finally:
        FlatParameters.stage_cpu_params, TorchDistributedTransport.stage_cpu_payloads = saved
    say(f"part 6: {len(out['rows'])} checks, {'all ok' if out['ok'] else 'some failed'}")
    return out
