"""The demo's synthetic classification data: Gaussian clusters around fixed class centroids, from a seed.

The Spark feed job and the ranks both import this module: the job to generate the training rows, the ranks to
draw a held-out set from the same centroids. Both derive everything from ``seed``, so they agree without
talking to each other.
"""

from __future__ import annotations

import numpy as np

# Centroid spread chosen so that the expected distance between two centroids is about 4.5 noise standard
# deviations whatever the number of features: the best possible accuracy is about 92 % with 10 classes, so
# a linear model has something to learn and cannot reach 100 %.
SEPARATION = 3.2


def centroids(classes: int, features: int, seed: int) -> np.ndarray:
    """The ``[classes, features]`` float32 class centres for ``seed``."""
    rng = np.random.default_rng([seed, 0])
    scale = SEPARATION / np.sqrt(features)
    return (rng.standard_normal((classes, features)) * scale).astype(np.float32)


def sample(n: int, centres: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows: float32 features ``[n, features]`` (a centre plus unit Gaussian noise) and int32 labels."""
    labels = rng.integers(0, len(centres), size=n, dtype=np.int32)
    noise = rng.standard_normal((n, centres.shape[1]), dtype=np.float32)
    return centres[labels] + noise, labels


def partition_rng(seed: int, partition: int) -> np.random.Generator:
    """The generator for one Spark partition of the training set: reproducible, independent per partition."""
    return np.random.default_rng([seed, 1, partition])


def holdout(n: int, classes: int, features: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A held-out set drawn from the training set's centroids, with its own random stream."""
    return sample(n, centroids(classes, features, seed), np.random.default_rng([seed, 2]))
