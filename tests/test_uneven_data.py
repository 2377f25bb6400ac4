"""Replicas whose training data ends at different steps are named at once (lightning_loco.replica.data_plan):
refused when fit starts where the lengths are known, and named by the peer that waits for them within seconds
where they are not (real processes, a process-group timeout of a minute: a regression shows as a failure)."""

from __future__ import annotations

import json
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_loco.replica.data_plan import (
    UNKNOWN,
    FitNumbers,
    PeerStops,
    UnevenDataError,
    check_plans,
    publish_failure,
    uneven_plans,
)
from lightning_loco.testing.launch import free_port, start_ranks
from lightning_loco.transport import PeerError

PG_TIMEOUT_S = 60  # what a peer would wait without the checks


def test_plans_that_agree_or_are_unknown_pass():
    assert uneven_plans([6, 6, 6]) is None
    assert uneven_plans([6, UNKNOWN, 6]) is None
    assert uneven_plans([UNKNOWN, UNKNOWN]) is None


def test_plans_that_differ_name_the_replicas_their_steps_and_the_fix():
    message = uneven_plans([30, 20, 30, 24])
    assert message is not None
    assert "replica 1 would stop at step 20; replica 3 would stop at step 24" in message
    assert "replica 0, replica 2 would go on to step 30" in message
    assert "max_steps" in message and "same length" in message and "elastic" in message
    several = uneven_plans([6, 6, 4, 6], ranks_per_replica=2)
    assert several is not None and "replica 1 (rank 2) would stop at step 4" in several


class FakeStore:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        if not self.check(keys):
            raise RuntimeError("wait timeout")


def test_plans_are_compared_through_the_store_and_a_peer_that_failed_first_is_named():
    store = FakeStore()
    store.set("fit/plan/1", "6")
    check_plans(store, "fit/", rank=0, world=2, steps=6)
    store.set("fit/plan/1", "4")
    store.set("fit/read/1", "1")  # rank 1 read every plan too: nobody stops before the others have read them
    store.set("fit/done/1", "1")  # and it is past its wait: rank 0, which may serve the store, stops last
    with pytest.raises(UnevenDataError, match="replica 1 would stop at step 4"):
        check_plans(store, "fit/", rank=0, world=2, steps=6)
    publish_failure(store, "next/", 1, ValueError("a callback failed"))
    started = time.monotonic()
    with pytest.raises(PeerError, match=r"Replica 1 \(rank 1\) failed as fit started \(ValueError: a callback"):
        check_plans(store, "next/", rank=0, world=2, steps=6)
    assert time.monotonic() - started < 5


def test_fit_numbers_stay_aligned_when_a_fit_fails_before_taking_one():
    numbers = FitNumbers()
    assert numbers.prefix() == numbers.prefix() == "lightning_loco/fit0/"
    numbers.end()
    assert numbers.prefix() == "lightning_loco/fit1/"  # a failure before the plans takes the fit's number too
    numbers.end()
    assert numbers.prefix() == "lightning_loco/fit2/"


def test_a_peer_that_stopped_before_posting_an_exchange_is_named_with_its_step_and_reason():
    store = FakeStore()
    a, b = PeerStops(store, "fit/", rank=0), PeerStops(store, "fit/", rank=1)
    for _ in range(2):
        a.posted([1]), b.posted([0])
    third = a.posted([1])
    a.check(third)  # b has not stopped: nothing to say
    b.publish(4, "ran out of training data")
    a.check({1: 2})  # b posted exchange 2
    with pytest.raises(UnevenDataError, match=r"Replica 1 ran out of training data: its fit ended at step 4 "
                                              r"without posting exchange 3 with replica 0, which replica 0 "
                                              r"waits for at its step 6") as err:
        a.check(third, step=6)
    assert isinstance(err.value, PeerError) and "max_steps" in str(err.value)


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


class Stream(IterableDataset):
    """An iterable dataset without a length: Lightning cannot know when it ends."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(self.batches)
        for _ in range(self.batches):
            yield torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)


def _replica(rank: int, port: int, out: str, iterable: bool) -> None:
    from lightning_loco import NoLoCoStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE="2")
    batches = 6 if rank == 0 else 4  # replica 1's shard is shorter
    if iterable:
        data = DataLoader(Stream(batches), batch_size=None)
    else:
        g = torch.Generator().manual_seed(rank)
        data = DataLoader(TensorDataset(torch.randn(2 * batches, 4, generator=g), torch.randn(2 * batches, 1)),
                          batch_size=2)
    strategy = NoLoCoStrategy(sync_every=2, timeout=timedelta(seconds=PG_TIMEOUT_S))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    started = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Tiny(), train_dataloaders=data)
        result = {"error": None}
    except Exception as err:  # noqa: BLE001  # what each rank saw, for the test to judge
        result = {"error": type(err).__name__, "message": str(err)}
    result["seconds"] = time.monotonic() - started
    result["step"] = trainer.global_step
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a rank left in a collective by its peer's error has nothing more to do


def run_replicas(tmp_path: Path, iterable: bool) -> dict[int, dict[str, Any]]:
    start_ranks(_replica, 2, args=(free_port(), str(tmp_path), iterable), timeout_s=3 * PG_TIMEOUT_S)
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}


def test_shards_of_known_different_lengths_are_refused_on_every_rank_when_fit_starts(tmp_path):
    results = run_replicas(tmp_path, iterable=False)
    for result in results.values():
        assert result["error"] == "UnevenDataError", result
        assert "replica 1 would stop at step 4" in result["message"]
        assert "replica 0 would go on to step 6" in result["message"]
        assert result["step"] == 0  # before any training
        assert result["seconds"] < PG_TIMEOUT_S / 2


def test_a_replica_whose_stream_ends_first_is_named_by_its_peer_within_seconds(tmp_path):
    results = run_replicas(tmp_path, iterable=True)
    waiting = results[0]  # replica 0 posts its third exchange at step 6; replica 1 stopped at step 4
    assert waiting["error"] == "UnevenDataError", waiting
    assert waiting["message"].startswith("Replica 1 ran out of training data")
    assert "its fit ended at step 4 without posting exchange 3 with replica 0" in waiting["message"]
    assert "max_steps" in waiting["message"]
    assert waiting["seconds"] < PG_TIMEOUT_S / 2
