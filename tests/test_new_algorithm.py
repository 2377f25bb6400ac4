"""A new algorithm is one file plus its registration: a toy one, defined here, runs through the driver, the
rules, overlap, fragments, the merge weighted by steps and a Lightning strategy, all from the capabilities it
declares (no code of the package names it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor

from lightning_loco import ElasticConfig, PacingConfig
from lightning_loco.algorithms.base import OuterAlgorithm, OuterState
from lightning_loco.algorithms.schedules import Round, everyone, random_groups
from lightning_loco.driver.driver import OuterStepDriver
from lightning_loco.driver.flat import FlatParameters
from lightning_loco.rules import RefusedOptions, build_options
from lightning_loco.trainer.base import OuterStepStrategy
from lightning_loco.transport import InProcessNetwork

from test_driver import run_in_threads, threaded

CPU = torch.device("cpu")


class AnchorState(OuterState):
    def __init__(self, anchor: Tensor) -> None:
        self.anchor = anchor

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.anchor.copy_(state_dict["anchor"])


class PairAverage(OuterAlgorithm):
    """H local steps, then average the live weights with one random peer (gossip local SGD)."""

    name = "pair_average"
    seeded_schedule = True  # its pairs come from (seed, t)
    overlap_share = 0.5  # overlap_steps="auto" may hide the exchange behind up to H/2 steps
    step_weighting = True  # apply divides the group's sum by its size and nothing else

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        return random_groups(num_replicas, 2, self.seed, outer_step)

    def init_state(self, weights: Tensor, shapes: Sequence[torch.Size]) -> AnchorState:
        return AnchorState(weights.clone())

    def payload(self, state: OuterState, weights: Tensor) -> Tensor:
        return weights

    def apply(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        state.anchor.copy_(group_sum / group_size)
        return state.anchor

    def final_weights(self, state: OuterState, group_sum: Tensor, group_size: int) -> Tensor:
        return group_sum / group_size

    def local_proxy(self, state: OuterState, weights: Tensor, group_size: int) -> Tensor:
        return weights.clone()


class AllAverage(PairAverage):
    """Every replica averages with all others: one all-reduce a round."""

    name = "all_average"
    collective = True
    seeded_schedule = False
    overlap_share = OuterAlgorithm.overlap_share  # what an algorithm that declares nothing gets

    def schedule(self, outer_step: int, num_replicas: int) -> Round:
        return everyone(num_replicas)


class PairAverageStrategy(OuterStepStrategy):
    """The toy's Lightning strategy: its algorithm, H, and every shared option."""

    strategy_name = "pair_average"
    description = "Periodic averaging with one random peer (a test's toy)"

    def __init__(self, sync_every: int = 4, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(PairAverage(seed), sync_every, **kwargs)


def replicas(options: dict[str, Any], n: int = 2, algorithm=PairAverage, clocks=None):
    network = InProcessNetwork(n, timeout=30.0)
    out = []
    for i in range(n):
        params = [torch.nn.Parameter(torch.full((3,), float(i))), torch.nn.Parameter(torch.full((2,), 10.0 * i))]
        clock = {"clock": clocks[i]} if clocks else {}
        driver = OuterStepDriver.of(algorithm(), network.transport(i), 4, **clock, **options)
        driver.add(FlatParameters(params, CPU))
        out.append((driver, params))
    return out


class Replica:
    def __init__(self, driver, params) -> None:
        self.driver, self.params = driver, params

    def step(self, index: int = 0) -> None:
        with torch.no_grad():
            for p in self.params:
                p.add_(1.0)
        self.driver.after_inner_step(index)

    def run(self, steps: int, index: int = 0) -> None:
        for _ in range(steps):
            self.step(index)


def weights(params) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def test_the_driver_runs_it_and_a_round_is_the_pair_average():
    pair = [Replica(*r) for r in replicas({})]
    threaded(pair, 4)  # one round at H = 4: both replicas end at the mean of their weights
    assert torch.equal(weights(pair[0].params), weights(pair[1].params))
    assert torch.equal(weights(pair[0].params), torch.tensor([4.5] * 3 + [9.0] * 2))


def test_fragments_draw_their_own_peers_and_auto_overlap_takes_its_share():
    (driver, _), _ = replicas({"fragments": 2})
    first, second = (slot.algorithm for slot in driver.slots)
    assert first.seed == 0 and second.seed != 0  # seeded_schedule: each fragment a seed of its own
    (driver, _), _ = replicas({"overlap_steps": "auto"})
    assert driver.slots[0].auto.cap == 2  # overlap_share = ½ of H = 4
    (driver, _), _ = replicas({"overlap_steps": "auto"}, algorithm=AllAverage)
    assert driver.slots[0].auto.cap == 1  # the default share, ¼


def test_the_merge_weighted_by_steps_serves_it_and_the_rules_read_its_capabilities():
    """Two replicas of speeds 1 and 2 under pacing, merge="steps": the round weights each by its H_i."""
    class Clock:
        def __init__(self) -> None:
            self.now = 0.0

        def __call__(self) -> float:
            return self.now

    clocks = [Clock(), Clock()]
    pair = replicas({"pacing": PacingConfig(4.0, merge="steps")}, clocks=clocks)
    for driver, _ in pair:
        driver.pacing.end_at(4)

    def train(i: int) -> None:
        driver, params = pair[i]
        for _ in range(4):
            clocks[i].now += 1.0 + i
            with torch.no_grad():
                for p in params:
                    p.add_(1.0)
            last = driver.last_step(0, 4)
            driver.after_inner_step(0, last=last)
            if last:
                return

    run_in_threads([lambda: train(0), lambda: train(1)])
    h = [pair[0][0].reports[0].phase_steps, pair[1][0].reports[0].phase_steps]
    assert h == [4, 2]
    grown = [weights(params) for _, params in pair]  # replica i's weights plus its own H_i, then the merge
    start = [torch.tensor([0.0] * 3 + [0.0] * 2), torch.tensor([1.0] * 3 + [10.0] * 2)]
    expected = ((start[0] + 4) * 4 + (start[1] + 2) * 2) / 6
    for w in grown:
        assert torch.allclose(w, expected)
    with pytest.raises(RefusedOptions) as refused:  # a collective algorithm: the elastic rule reads it
        build_options(AllAverage(), 4, elastic=ElasticConfig("localhost:1"), ranks_per_replica=2, wire="int8")
    assert refused.value.rules == ("elastic-collective-lossy-ranks",)
    build_options(PairAverage(), 4, elastic=ElasticConfig("localhost:1"), ranks_per_replica=2, wire="int8")


def test_its_strategy_registers_and_resolves_by_name():
    PairAverageStrategy.register_strategies(StrategyRegistry)
    try:
        trainer = L.Trainer(strategy="pair_average", accelerator="cpu", devices=2, logger=False)
        assert type(trainer.strategy) is PairAverageStrategy and trainer.strategy.sync_every == 4
        with pytest.raises(RefusedOptions, match="overlap_steps=4 must be smaller than sync_every=4"):
            PairAverageStrategy(overlap_steps=4)
    finally:
        StrategyRegistry.remove("pair_average")


@pytest.mark.slow
def test_two_processes_train_with_it(tmp_path):
    import tiny

    PairAverageStrategy.register_strategies(StrategyRegistry)  # the forked ranks inherit the registration
    try:
        recs = tiny.launch(tmp_path, strategy="pair_average", strategy_kwargs={"sync_every": 2}, devices=2,
                           max_steps=6)
    finally:
        StrategyRegistry.remove("pair_average")
    for step in (1, 3, 5):  # after each round the pair holds one model
        assert torch.equal(recs[0]["weights"][step], recs[1]["weights"][step]), step
    assert not torch.equal(recs[0]["weights"][0], recs[1]["weights"][0])  # apart in between
    assert [r["outer_step"] for r in recs[0]["reports"]] == [0, 1, 2]
