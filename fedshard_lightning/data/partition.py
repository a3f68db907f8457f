"""Client partitions of a labelled dataset: IID, Dirichlet label skew and a two-group label split.

The Dirichlet scheme is the NIID-Bench "label-dir" scheme (Li et al., ICDE 2022; also FedLab):
for every class, a Dir(rho) vector splits that class's samples over the clients, with the
NIID-Bench balancing step (a client already holding N/K samples or more takes no more), and the
whole draw is repeated until every client holds at least ``min_size`` samples. Where a tiny rho
puts exactly zero weight on every client still open (NIID-Bench would divide by zero), the class
is split by a fresh Dir(rho) over the open clients only: the law of the first draw restricted to
them, so full clients stay full and a smaller rho never spreads a class more. The label split is
the "two label partitions" setting of the FedShard paper (Appendix G.5): a fraction of the clients
(48 of 64 by default) sees one half of the labels, the rest the other half.
"""

from __future__ import annotations

import numpy as np

from fedshard_lightning.errors import ConfigError, DataError

__all__ = ["dirichlet_partition", "iid_partition", "label_split_partition"]


def _check_clients(num_samples: int, num_clients: int, min_size: int) -> None:
    if num_clients < 1:
        raise ConfigError(f"num_clients={num_clients}: must be a positive integer")
    if num_clients * max(min_size, 1) > num_samples:
        raise ConfigError(
            f"num_clients={num_clients}: the dataset has {num_samples} training samples, too few for "
            f"{num_clients} clients of at least {max(min_size, 1)} samples; lower num_clients or min_client_size"
        )


def iid_partition(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and split into near-equal parts (sizes differ by at most one)."""
    _check_clients(num_samples, num_clients, 1)
    perm = rng.permutation(num_samples)
    return [np.sort(part) for part in np.array_split(perm, num_clients)]


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    rho: float,
    min_size: int,
    rng: np.random.Generator,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """NIID-Bench label-dir partition, re-drawn until every client has ``min_size`` samples."""
    if not rho > 0:
        raise ConfigError(f"rho={rho}: the Dirichlet concentration must be > 0 (e.g. 0.1 or 0.5)")
    labels = np.asarray(labels)
    n = len(labels)
    _check_clients(n, num_clients, min_size)
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == k) for k in classes]
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, rho))
            open_ = sizes < n / num_clients
            p = p * open_
            total = p.sum()
            if total <= 0:  # every open client drew exactly 0 (tiny rho): Dir(rho) over the open ones
                p = np.zeros(num_clients)
                p[open_] = rng.dirichlet(np.full(int(open_.sum()), rho))
                total = p.sum()
            p = p / total
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for c, chunk in enumerate(np.split(idx, cuts)):
                parts[c].extend(chunk.tolist())
                sizes[c] += len(chunk)
        if sizes.min() >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise DataError(
        f"num_clients={num_clients}: no Dirichlet(rho={rho}) partition gave every client >= {min_size} samples "
        f"in {max_tries} draws; lower num_clients or min_client_size, or raise rho"
    )


def label_split_partition(
    labels: np.ndarray, num_clients: int, fraction: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Two groups of clients on disjoint halves of the labels, IID inside each group."""
    if not 0 < fraction < 1:
        raise ConfigError(f"label_split_fraction={fraction}: must be strictly between 0 and 1 (e.g. 0.75)")
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if len(classes) < 2:
        raise DataError("label_split needs at least two classes in the training data")
    first_classes = classes[: len(classes) // 2]
    k_first = round(num_clients * fraction)
    k_first = min(max(k_first, 1), num_clients - 1)
    if num_clients < 2:
        raise ConfigError(f"num_clients={num_clients}: label_split needs at least 2 clients")
    in_first = np.isin(labels, first_classes)
    groups = [(np.flatnonzero(in_first), k_first), (np.flatnonzero(~in_first), num_clients - k_first)]
    parts: list[np.ndarray] = []
    for idx, k in groups:
        _check_clients(len(idx), k, 1)
        parts.extend(np.sort(p) for p in np.array_split(rng.permutation(idx), k))
    return parts
