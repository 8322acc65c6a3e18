"""The padding share of benchmarks/padding.py: padded slots that are padding / all padded slots."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

# Loaded by path, not by putting benchmarks/ on sys.path: its modules (common, report, ...) would shadow others.
_spec = importlib.util.spec_from_file_location(
    "sparkbus_bench_padding", Path(__file__).resolve().parents[2] / "benchmarks" / "padding.py")
padding = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)   # dataclasses look it up there
_spec.loader.exec_module(padding)
lengths_of, padding_share = padding.lengths_of, padding.padding_share


def test_each_batch_is_padded_to_its_own_longest_row():
    # [1, 3]: 6 slots, 4 real; [2, 2, 2]: 6 slots, 6 real -> 2 of 12 slots are padding
    assert padding_share([[1, 3], np.array([2, 2, 2])]) == pytest.approx(2 / 12)
    assert padding_share([[5], [7, 7]]) == 0.0
    assert padding_share([[1, 9]]) == pytest.approx(8 / 18)


def test_no_slots_no_padding():
    assert padding_share([]) == 0.0
    assert padding_share([[], np.zeros(0, np.int64)]) == 0.0
    assert padding_share([[0, 0]]) == 0.0


def test_sorting_rows_by_length_before_batching_lowers_the_share():
    lengths = np.random.default_rng(1).lognormal(np.log(16), 0.7, 4096).round().clip(1, 128).astype(int)
    plain = padding_share(np.split(lengths, 64))
    bucketed = padding_share(np.split(np.sort(lengths), 64))
    assert plain > 0.5 and bucketed < 0.1 * plain


def test_lengths_of_a_uniform_batch_are_its_width():
    np.testing.assert_array_equal(lengths_of(np.zeros((3, 5), np.int32)), [5, 5, 5])

    class Ragged:                       # anything with lengths(), as worker.RaggedColumn
        def lengths(self):
            return np.array([1, 4])

    np.testing.assert_array_equal(lengths_of(Ragged()), [1, 4])
