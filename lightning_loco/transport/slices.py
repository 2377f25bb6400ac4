"""A replica of several ranks: the all-gather that makes a flat buffer whole from each rank's slice (its
``torch.tensor_split`` part), used by the torch.distributed transport and by the elastic one."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_slices"]

def all_gather_slices(part: Tensor, like: Tensor, k: int, group: Any) -> Tensor:
    """The whole of ``like``'s k slices (``torch.tensor_split``) from each rank's ``part``: an all-gather over
    ``group``, the replica's k ranks (also the elastic transport's, for a replica of several ranks)."""
    sizes = [t.numel() for t in torch.tensor_split(like, k)]
    padded = torch.zeros(max(sizes), dtype=part.dtype, device=part.device)
    padded[: part.numel()] = part
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([t[:n] for t, n in zip(parts, sizes)])
