"""PPO mini-batch planning (psrl.trainer.minibatch): whole groups, equal steps on every rank."""

import pytest

from psrl.trainer.minibatch import count_mini_batches, plan_mini_batches, split_groups

# 5 groups of 2: g0 = samples 0,1; g1 = 2,3; ...
GROUPS = [f"g{i // 2}" for i in range(10)]


def _group_sets(step, ids):
    return {ids[i] for i in step}


def test_whole_batch_is_one_step_by_default():
    assert plan_mini_batches(GROUPS, mini_batch_size=None, epochs=1, seed=[0]) == [list(range(10))]


def test_mini_batches_of_whole_groups_cover_the_batch_once_per_epoch():
    plan = plan_mini_batches(GROUPS, mini_batch_size=2, epochs=2, seed=[0, 3])
    assert len(plan) == 2 * 3  # ceil(5 / 2) mini-batches per epoch
    for epoch in (plan[:3], plan[3:]):
        assert sorted(i for step in epoch for i in step) == list(range(10))
        # sizes in groups as even as can be: 2, 1, 2 (or a permutation)
        assert sorted(len(_group_sets(s, GROUPS)) for s in epoch) == [1, 2, 2]
        for step in epoch:  # whole groups only
            assert all(GROUPS.count(g) == sum(GROUPS[i] == g for i in step) for g in _group_sets(step, GROUPS))


def test_plan_is_deterministic_and_epochs_reshuffle_groups():
    a = plan_mini_batches(GROUPS, mini_batch_size=1, epochs=3, seed=[7, 1])
    assert a == plan_mini_batches(GROUPS, mini_batch_size=1, epochs=3, seed=[7, 1])
    assert a[:5] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # the first epoch in batch order
    assert a[5:10] != a[:5] or a[10:] != a[:5]


def test_a_rank_share_takes_as_many_steps_as_the_whole_batch_gives():
    # 5 groups over two ranks (3 + 2), 2 groups a mini-batch: ceil(5/2) = 3 steps on both ranks.
    share0 = ["a", "a", "b", "b", "c", "c"]
    share1 = ["d", "d", "e", "e"]
    p0 = plan_mini_batches(share0, mini_batch_size=2, epochs=1, seed=[0], total_groups=5)
    p1 = plan_mini_batches(share1, mini_batch_size=2, epochs=1, seed=[0], total_groups=5)
    assert len(p0) == len(p1) == 3
    assert sum(1 for s in p1 if not s) == 1  # the smaller share sits one step out (a zero-weight step)


@pytest.mark.parametrize("size, match", [
    (0, "must be a positive number of groups, got 0"),
    (-1, "must be a positive number of groups"),
    (6, r"ppo_mini_batch_size=6 is larger than the batch \(5 groups\)"),
])
def test_bad_sizes_are_clear_errors(size, match):
    with pytest.raises(ValueError, match=match):
        count_mini_batches(5, size)


def test_counts_and_splits():
    assert [count_mini_batches(8, m) for m in (1, 3, 4, 8)] == [8, 3, 2, 1]
    assert split_groups([[0], [1], [2]], 2) in ([[0], [1, 2]], [[0, 1], [2]])
    assert split_groups([[0]], 2) in ([[], [0]], [[0], []])
    with pytest.raises(ValueError, match="ppo_epochs must be >= 1"):
        plan_mini_batches(GROUPS, mini_batch_size=1, epochs=0, seed=[0])
