import pytest
import torch

from lightning_loco.algorithms.schedules import Round, everyone, random_groups, random_matching, round_generator


def assert_partition(round_: Round, n: int) -> None:
    members = [i for g in round_.groups for i in g]
    assert sorted(members) == list(range(n)), round_.groups  # everyone exactly once: no replica twice
    for g in round_.groups:
        assert len(set(g)) == len(g)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16, 33])
@pytest.mark.parametrize("group_size", [2, 3, 4])
def test_groups_partition_replicas_and_last_takes_remainder(n, group_size):
    for t in range(20):
        r = random_groups(n, group_size, seed=3, outer_step=t)
        assert_partition(r, n)
        sizes = [len(g) for g in r.groups]
        if n < group_size:
            assert sizes == [n]
        else:
            assert sizes[:-1] == [group_size] * (n // group_size - 1)
            assert sizes[-1] == group_size + n % group_size
        assert not r.collective


def test_five_replicas_in_pairs_gives_sizes_two_and_three():
    assert sorted(len(g) for g in random_groups(5, 2, 0, 0).groups) == [2, 3]


def test_no_replica_is_its_own_peer():
    for t in range(50):
        r = random_groups(6, 2, 0, t)
        for i in range(6):
            peers = r.peers_of(i)
            assert i not in peers and len(peers) == 1
    assert random_groups(1, 2, 0, 0).peers_of(0) == ()


def test_schedule_is_identical_on_every_rank_and_ignores_global_rng():
    # Each rank computes the schedule independently: it must depend on (seed, t) only.
    torch.manual_seed(1)
    a = [random_groups(8, 2, 5, t) for t in range(10)]
    torch.manual_seed(2)
    torch.rand(100)
    state = torch.get_rng_state()
    b = [random_groups(8, 2, 5, t) for t in range(10)]
    assert a == b
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not consumed


def test_schedule_changes_with_outer_step_and_seed():
    rounds = {random_groups(8, 2, 0, t).groups for t in range(10)}
    assert len(rounds) > 5
    assert [random_groups(8, 2, 0, t) for t in range(5)] != [random_groups(8, 2, 1, t) for t in range(5)]
    # over many rounds every replica meets several different peers
    met = {j for t in range(30) for j in random_groups(8, 2, 0, t).peers_of(0)}
    assert len(met) >= 5


def test_schedule_regression_pin():
    # Resumed runs must keep choosing the same peers: pin the first rounds of one schedule.
    assert [random_groups(8, 2, 0, t).groups for t in range(2)] == [
        ((2, 3), (1, 5), (0, 6), (4, 7)),
        ((1, 6), (2, 4), (3, 7), (0, 5)),
    ]
    # the generator behind every random schedule (GASLoC's matchings included)
    assert torch.randint(0, 1000, (3,), generator=round_generator(0, 0)).tolist() == [811, 699, 347]
    assert [random_matching(8, 0, t).groups for t in range(2)] == [
        ((2, 3), (1, 5), (0, 6), (4, 7)),
        ((1, 6), (2, 4), (3, 7), (0, 5)),
    ]


def test_everyone_is_one_collective_group():
    r = everyone(4)
    assert r.groups == ((0, 1, 2, 3),) and r.collective
    assert r.peers_of(2) == (0, 1, 3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="group_size"):
        random_groups(4, 1, 0, 0)
    with pytest.raises(ValueError, match="num_replicas"):
        random_groups(0, 2, 0, 0)
    with pytest.raises(ValueError, match="no group"):
        everyone(2).group_of(5)
