"""B1's latency model (``benchmarks.latency_model``) on rows of the published B1 result: the columns it adds
keep the published ones, and our chunked all-reduce's grows like its two exchanges, not like a ring's steps."""

import json
import math
import statistics
from pathlib import Path

from benchmarks.latency_model import latency_model
from benchmarks.netem.links import uniform

ROWS = json.loads((Path(__file__).parent.parent / "benchmarks/results/b1_sync_latency.json").read_text())


# up to N = 256, which draws the same values as up to 1024 for the N it has (each N draws after the smaller ones),
# in a twentieth of the time: the ring's 2(N − 1) steps of N draws, 100 times, are most of it
def test_the_published_columns_are_drawn_as_before_and_the_chunked_all_reduce_has_two_steps() -> None:
    model = latency_model(ROWS["rows"], trials=100, largest=256)
    published = ROWS["latency_model"]["predictions"]
    assert [p["replicas"] for p in published][-1] == 1024 and [p["replicas"] for p in model["predictions"]][-1] == 256
    for new, old in zip(model["predictions"], published[:8], strict=True):
        for column in ("pair_s", "tree_allreduce_s", "ring_allreduce_s"):
            assert new[column] == old[column]  # the new column draws from its own generator
    link = uniform(2, mbit=100, one_way_ms=50)
    latency, rate = link.one_way_s(0, 1), link.links[0].bytes_per_s
    for p in model["predictions"]:
        n = p["replicas"]
        sends = 2 * (n - 1) * 4 * model["params"] / n / rate
        # two latencies, each the slowest of N(N − 1) log-normal draws of mean `latency`: at least the mean's
        # two latencies, and below the (1 − 10⁻⁹) quantile's
        top = latency * math.exp(-0.045 + 0.3 * statistics.NormalDist().inv_cdf(1 - 1e-9))
        assert sends + 2 * latency * 0.9 < p["chunked_allreduce_s"] < sends + 2 * top
        assert p["chunked_over_pair"] == p["chunked_allreduce_s"] / p["pair_s"]
    by_n = {p["replicas"]: p for p in model["predictions"]}
    assert by_n[256]["chunked_allreduce_s"] < by_n[256]["tree_allreduce_s"] < by_n[256]["ring_allreduce_s"]
