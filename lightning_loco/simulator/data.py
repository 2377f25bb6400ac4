"""Each simulated replica's data: its shard, as Lightning gives it to the replica's rank, epoch after epoch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional

from torch.utils.data import DataLoader, Dataset, DistributedSampler

Batch = Any


def distributed_shards(
    dataset: Dataset, num_replicas: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False
) -> list[DataLoader]:
    """Replica ``i``'s batches exactly as Lightning gives them to replica ``i`` of a strategy with
    ``num_replicas`` replicas: a ``DistributedSampler`` with that rank, the run's seed, and the epoch
    set at each pass (the simulator calls ``set_epoch``)."""
    return [
        DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=DistributedSampler(dataset, num_replicas, i, shuffle=shuffle, seed=seed, drop_last=drop_last),
        )
        for i in range(num_replicas)
    ]


class Shard:
    """Endless batches of one replica's shard, one epoch after another.

    ``epoch`` and ``batch_idx`` (the index in its epoch, as ``training_step`` gets it) describe the
    batch returned last; ``at_epoch_end`` says whether it was its epoch's last, known from ``len``
    (a source without ``len`` only shows its end when the next batch starts a new epoch)."""

    def __init__(self, source: Iterable[Batch]) -> None:
        self.source, self.epoch, self.batch_idx = source, 0, -1
        self._it: Optional[Iterator[Batch]] = None
        try:
            self.length: int | None = len(source)  # type: ignore[arg-type]
        except TypeError:
            self.length = None

    def next(self) -> Batch:
        while True:
            if self._it is None:
                sampler = getattr(self.source, "sampler", None)
                if sampler is not None and hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self.epoch)
                self._it = iter(self.source)
                self.batch_idx = -1
            try:
                batch = next(self._it)
            except StopIteration:
                if self.batch_idx < 0:
                    raise ValueError("a replica's shard yielded no batch: give every replica at least one") from None
                self._it = None
                self.epoch += 1
                continue
            self.batch_idx += 1
            return batch

    @property
    def at_epoch_end(self) -> bool:
        return self.length is not None and self.batch_idx + 1 >= self.length

    def draw(self, count: int) -> list[tuple[Batch, int, int]]:
        """Up to ``count`` batches for one optimizer step, as ``(batch, batch_idx, epoch)``: fewer where
        the epoch ends first (Lightning steps the optimizer at the end of an epoch whatever the
        accumulation, and the next window starts with the next epoch)."""
        drawn: list[tuple[Batch, int, int]] = []
        while len(drawn) < count:
            batch = self.next()
            drawn.append((batch, self.batch_idx, self.epoch))
            if self.at_epoch_end:
                break
        return drawn
