"""The mixture's plan without Spark (feeder/mixture.py, docs/MIXTURES.md): exact counts per window, every slot of an
epoch filled once, passes reshuffled and numbered across epochs, a small source repeating and a large one read
without replacement, all fixed by the seed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from sparkbus import feed_mixture
from sparkbus.feeder.mixture import MixturePlan, PassPermutation, block_rows, exact_window, smooth_layout, window_counts

pytestmark = pytest.mark.timeout(60)


def epoch_table(plan: MixturePlan, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per slot of ``epoch``: (source, row, pass), from each source's side (what a Spark task computes from its
    rows), checked against the plan's inverse (:meth:`MixturePlan.at`)."""
    source = np.full(plan.rows_per_epoch, -1)
    row = np.full(plan.rows_per_epoch, -1)
    number = np.full(plan.rows_per_epoch, -1)
    for s, n in enumerate(plan.sizes):
        rows = np.arange(n)
        at, slots = plan.epoch_draws(s, epoch, rows)
        assert (source[slots] == -1).all(), "a slot filled twice"
        source[slots], row[slots] = s, rows[at]
        number[slots] = plan.passes(s, plan.at(epoch, slots)[1])
    assert (source >= 0).all(), "a slot left empty"
    by_plan, k = plan.at(epoch, np.arange(plan.rows_per_epoch))
    np.testing.assert_array_equal(by_plan, source)
    for s in range(len(plan.sizes)):
        mine = source == s
        np.testing.assert_array_equal(plan.rows(s, k[mine]), row[mine])
    return source, row, number


@pytest.mark.parametrize("weights, window, counts", [
    ([0.7, 0.3], 10, (7, 3)), ([0.7, 0.3], 1024, (717, 307)), ([1, 1, 1], 10, (4, 3, 3)),
    ([0.5, 0.25, 0.25], 64, (32, 16, 16)), ([0.6, 0.3, 0.1], 7, (4, 2, 1)), ([2, 1], 3, (2, 1)),
    ([0.1, 0.2, 0.3, 0.4], 100, (10, 20, 30, 40)), ([1, 0], 8, (8, 0))])
def test_counts_per_window_are_the_largest_remainder_and_the_layout_spreads_them(weights, window, counts):
    assert window_counts(weights, window) == counts
    layout = smooth_layout(counts)
    assert len(layout) == window and Counter(layout) == {s: c for s, c in enumerate(counts) if c}
    for s, c in enumerate(counts):      # evenly: in any prefix, within one row of its share
        if c:
            seen = np.cumsum(np.asarray(layout) == s)
            assert np.all(np.abs(seen - np.arange(1, window + 1) * c / window) <= 1 + 1e-9), (s, layout)


def test_bad_weights_and_windows_are_refused_saying_why():
    with pytest.raises(ValueError, match="larger window"):
        window_counts([0.99, 0.01], 10)
    with pytest.raises(ValueError, match="one at least positive"):
        window_counts([0, 0], 10)
    with pytest.raises(ValueError, match="not negative"):
        window_counts([1, -1], 10)
    with pytest.raises(ValueError, match="at least 1"):
        window_counts([1], 0)
    with pytest.raises(ValueError, match="one weight per source"):
        MixturePlan.make({"a": 10, "b": 10}, {"a": 1}, 10)
    with pytest.raises(ValueError, match="no rows"):
        MixturePlan.make({"a": 10, "b": 0}, {"a": 1, "b": 1}, 10)


def test_the_default_window_with_token_budgets_is_the_smallest_exact_one():
    assert exact_window([0.7, 0.3]) == 10 and exact_window([1, 1, 1]) == 3 and exact_window([0.5, 0.5]) == 2
    assert exact_window([1 / 3, 2 / 3 - 1e-3]) == 100          # none exact up to 100: 100
    assert block_rows(10_000, 3, 1024) == 4096 and block_rows(100, 8, 10) == 20


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 1000, 4097])
def test_a_pass_is_a_permutation_and_its_inverse(n):
    perm = PassPermutation(n, seed=5, source="web", number=2)
    positions = perm.forward(np.arange(n))
    assert sorted(positions.tolist()) == list(range(n))
    np.testing.assert_array_equal(perm.backward(positions), np.arange(n))
    # a subset of the rows (one Spark partition) is placed as in the whole
    np.testing.assert_array_equal(perm.forward(np.arange(n)[n // 3:]), positions[n // 3:])


def test_passes_are_reshuffled_and_fixed_by_the_seed():
    orders = {(seed, source, number): tuple(PassPermutation(500, seed, source, number).forward(np.arange(500)))
              for seed in (0, 1) for source in ("web", "code") for number in (0, 1, 2)}
    assert len(set(orders.values())) == len(orders), "every (seed, source, pass) has its own order"
    again = PassPermutation(500, 0, "web", 1).forward(np.arange(500))
    assert tuple(again) == orders[(0, "web", 1)]
    # not the identity nor a rotation: the row at position 0 of consecutive positions are spread
    assert np.mean(np.abs(np.diff(again))) > 50


@pytest.mark.parametrize("weights, window, rows", [({"web": 0.7, "code": 0.3}, 10, 1_000),
                                                   ({"web": 0.7, "code": 0.3}, 64, 1_000),
                                                   ({"a": 1, "b": 1, "c": 2}, 8, 803)])
def test_every_window_of_every_epoch_holds_exactly_its_counts(weights, window, rows):
    plan = MixturePlan.make({name: 37 + 300 * i for i, name in enumerate(sorted(weights))}, weights, window, rows)
    for epoch in range(3):
        source, _, _ = epoch_table(plan, epoch)
        whole = rows // window * window
        per_window = np.stack([np.bincount(w, minlength=len(weights)) for w in source[:whole].reshape(-1, window)])
        assert (per_window == np.asarray(plan.counts)).all()
        tail = source[whole:]       # the epoch's partial window: the first slots of the layout
        np.testing.assert_array_equal(tail, np.asarray(plan.layout)[:len(tail)])


def test_a_small_source_repeats_in_numbered_passes_each_once_and_reshuffled():
    plan = MixturePlan.make({"small": 30, "large": 10_000}, {"small": 0.5, "large": 0.5}, 10, 200, seed=7)
    s = plan.source("small")
    assert plan.draws(s) == 100                  # 100 draws an epoch from 30 rows: passes 0..3 in epoch 0
    passes: dict[int, list[int]] = {}
    for epoch in range(3):
        source, row, number = epoch_table(plan, epoch)
        for p, r in zip(number[source == s], row[source == s]):
            passes.setdefault(int(p), []).append(int(r))
    assert sorted(passes) == list(range(10))     # 300 draws: passes 0..9, the last begun (300 = 10 * 30)
    for p, rows in passes.items():
        assert sorted(rows) == list(range(30)), f"pass {p}: every row once"
    # each pass in its own order: the slot order of the draws differs pass to pass
    assert len({tuple(rows) for rows in passes.values()}) == len(passes)
    # a pass spanning two epochs (pass 3: draws 90..119) is one permutation, split between them
    first, _, n0 = epoch_table(plan, 0)
    second, _, n1 = epoch_table(plan, 1)
    assert 3 in set(n0[first == s]) and 3 in set(n1[second == s])


def test_a_large_source_is_read_without_replacement_across_epochs():
    plan = MixturePlan.make({"small": 30, "large": 1_000}, {"small": 0.3, "large": 0.7}, 10, 400, seed=3)
    large = plan.source("large")
    assert plan.draws(large) == 280
    seen = []
    for epoch in range(3):            # 840 draws of 1,000 rows: all in pass 0, none twice
        source, row, number = epoch_table(plan, epoch)
        seen.extend(row[source == large].tolist())
        assert set(number[source == large]) == {0}
    assert len(seen) == len(set(seen)) == 840
    source, row, number = epoch_table(plan, 3)     # draws 840..1119: the rest of pass 0, then pass 1 begins
    rows = row[source == large]
    assert set(rows[number[source == large] == 0]) == set(range(1_000)) - set(seen)
    assert (number[source == large] == 1).sum() == 120


def test_the_plan_is_a_function_of_the_seed_not_of_the_order_of_the_sources():
    sizes, weights = {"web": 500, "code": 90}, {"web": 0.7, "code": 0.3}
    one = MixturePlan.make(sizes, weights, 10, 700, seed=1)
    same = MixturePlan.make(dict(reversed(list(sizes.items()))), dict(reversed(list(weights.items()))), 10, 700,
                            seed=1)
    other = MixturePlan.make(sizes, weights, 10, 700, seed=2)
    for epoch in range(2):
        a, b, c = epoch_table(one, epoch), epoch_table(same, epoch), epoch_table(other, epoch)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(a[0], c[0])                   # the same counts and layout
        assert (a[1] != c[1]).any()                                  # other rows in the slots


@pytest.mark.parametrize("counts", [(7, 3), (717, 307), (4, 3, 3), (10, 20, 30, 40), (1, 99)])
def test_any_run_of_consecutive_slots_holds_each_share_within_two_rows(counts):
    """What a token-budget batch holds (docs/MIXTURES.md): a run of slots, across windows, of any length."""
    layout = np.tile(smooth_layout(counts), 3)
    window = sum(counts)
    for s, c in enumerate(counts):
        seen = np.concatenate([[0], np.cumsum(layout == s)])
        for length in range(1, 2 * window + 1, max(1, window // 50)):
            run = seen[length:] - seen[:-length]           # every run of this length
            assert np.all(np.abs(run - length * c / window) < 2), (s, length)


class Frame:
    """Stands in for a DataFrame where feed_mixture refuses before any Spark job."""

    def __init__(self, *columns: str) -> None:
        self.columns = list(columns)


@pytest.mark.parametrize("sources, weights, more, message", [
    ({}, {}, {}, "at least one source"),
    ({"a": Frame("x"), "b": Frame("x")}, {"a": 1}, {}, "one weight per source"),
    ({"a": Frame("x"), "b": Frame("y")}, {"a": 1, "b": 1}, {}, "columns differ"),
    ({"a": Frame("source"), "b": Frame("source")}, {"a": 1, "b": 1}, {}, "another source_column"),
    ({"a": Frame("x")}, {"a": 1}, {"slot_column": "x"}, "another source_column= or slot_column="),
    ({"a": Frame("x"), "b": Frame("x")}, {"a": 0.999, "b": 0.001}, {"batch_size": 64}, "larger window"),
    ({"a": Frame("x")}, {"a": 1}, {"resume": {"stream": "other", "epoch": 0}}, "of stream 'other'"),
    ({"a": Frame("x")}, {"a": 1}, {"resume": 3, "epochs": 2}, "not one of the epochs"),
])
def test_feed_mixture_refuses_before_any_spark_job_saying_why(sources, weights, more, message):
    with pytest.raises(ValueError, match=message):
        feed_mixture(sources, "tcp://127.0.0.1:1", weights=weights, **more)
