"""Per-client quantities of the fairness metrics: client alpha (probe round) and per-client accuracy.

SPEC section 4, "Client alpha": one *probe round* in which every client trains one FedAvg round
alone, all from the same reference model (default: the trained global model), through the
algorithm's own engine, so the local schedule, optimizer and keyed randomness are exactly those
of training. The update of client ``c`` is ``u_c = theta_c - theta_ref``; the reference update
``g`` is the sample-weighted mean of the ``u_c`` (the aggregated probe update, which is what a
FedAvg server would apply); ``alpha_c`` is the signed angle between ``u_c`` and ``g``
(:func:`~fedshard_lightning.sharding.signed_angles`).

The probe trains at stage :data:`PROBE_STAGE`, a constant no algorithm uses as a training stage,
so its keyed shuffles never coincide with those of training or unlearning (the randomness key is
``(seed, stage, group, round, client)``). Each client is its own group with key ``c``.

:func:`per_client_accuracy` evaluates one model on every client's own data (``Y(D_c)`` of paper
section 5) by predicting the whole training tensor once and averaging per client, instead of one
forward pass per client.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fedshard_lightning.engine import Group, predict_logits
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.sharding.contribution import flatten_update, signed_angles

__all__ = [
    "PROBE_STAGE",
    "checked_alphas",
    "client_alphas",
    "client_probe_updates",
    "per_client_accuracy",
    "sample_logits",
]

PROBE_STAGE = 2**30 + 7
"""Stage number of the probe round's keyed randomness; far above any training stage."""


def _algorithm(source: Any) -> Any:
    """The algorithm of a trainer, or ``source`` itself when it already is one."""
    alg = getattr(source, "algorithm", source)
    if getattr(alg, "engine", None) is None:
        raise ValueError(
            "client_alphas needs an algorithm set up by a trainer (call trainer.fit or load a run first)"
        )
    return alg


def client_probe_updates(
    source: Any,
    reference_params: dict[str, Tensor] | None = None,
    clients: Sequence[int] | None = None,
) -> Tensor:
    """Flattened float64 updates ``[len(clients), D]`` of one probe round from ``reference_params``.

    Args:
        source: A :class:`~fedshard_lightning.trainer.trainer.FederatedTrainer` or an attached algorithm.
        reference_params: Model every client starts from; default the algorithm's current model.
        clients: Clients to probe, default all ``K`` clients of the partition.

    Returns:
        One row per client, ``theta_c - theta_ref`` over the trainable parameters, flattened in
        sorted name order. BatchNorm running statistics are left out (SPEC section 4): they are
        not learned, and their scale would tilt the angle.
    """
    alg = _algorithm(source)
    # Every probed client trains its round: a method's own sampling (FATS, client_fraction < 1)
    # would leave some with no update, and a test's scripted sampler has no probe round.
    engine = alg.engine.with_participants(_everyone)
    if reference_params is None:
        reference_params = alg.current_params()
    ids = list(range(alg.num_clients)) if clients is None else [int(c) for c in clients]
    if not ids:
        raise ValueError("client_probe_updates: no client to probe")
    ref = {k: v.detach() for k, v in reference_params.items()}
    init = {k: v.unsqueeze(0).expand(len(ids), *v.shape).clone() for k, v in ref.items()}
    groups = [Group(c, (c,), 1) for c in ids]
    res = engine.train_groups(init, groups, stage=PROBE_STAGE)
    names = [k for k in engine.names if k in ref]  # SPEC 4: trainable parameters, no BN statistics
    return flatten_update(
        {k: res.params[k] for k in names}, {k: ref[k] for k in names}, stacked=True, dtype=torch.float64
    )


def _everyone(stage: int, group: Group, round_: int) -> list[int]:
    """The probe's participant policy: every client of the group, every round."""
    return list(group.clients)


def checked_alphas(alphas: Sequence[float], field: str) -> Tensor:
    """Given client alphas as a float64 tensor: finite angles in ``[-pi, pi]``, or a ConfigError naming ``field``."""
    try:
        out = torch.tensor([float(a) for a in alphas], dtype=torch.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"{field}: give a list of numbers, one per client") from None
    if not bool(torch.isfinite(out).all()) or bool((out.abs() > math.pi).any()):
        raise ConfigError(f"{field}: every alpha must be a finite angle in [-pi, pi]")
    return out


def client_alphas(
    source: Any,
    reference_params: dict[str, Tensor] | None = None,
    clients: Sequence[int] | None = None,
) -> Tensor:
    """Signed contribution angle ``alpha_c`` of every client (SPEC section 4, client alpha).

    Args:
        source: A :class:`~fedshard_lightning.trainer.trainer.FederatedTrainer` or an attached algorithm
            (anything with ``algorithm.engine`` or ``engine``).
        reference_params: The shared reference model; default the algorithm's current (trained)
            global model. Methods compared side by side should pass the same one.
        clients: Clients to probe (default all ``K``); the reference update ``g`` is the mean of
            *these* clients' updates weighted by their sample counts.

    Returns:
        float64 tensor ``[len(clients)]`` of angles in ``[-pi, pi]``.
    """
    alg = _algorithm(source)
    ids = list(range(alg.num_clients)) if clients is None else [int(c) for c in clients]
    updates = client_probe_updates(alg, reference_params, ids)
    sizes = alg.ctx.client_sizes
    weights = torch.tensor([float(sizes[c]) for c in ids], dtype=torch.float64, device=updates.device)
    if len(ids) == 1:
        return torch.zeros(1, dtype=torch.float64, device=updates.device)
    return signed_angles(updates, weights)


@torch.no_grad()
def sample_logits(
    module: nn.Module,
    params: dict[str, Tensor],
    datamodule: Any,
    indices: Tensor | None = None,
    batch_size: int = 2048,
) -> Tensor:
    """Logits of the model on training samples (all, or those at ``indices``), normalised as in training.

    The samples are converted batch by batch, so the full training set is never held as floats.
    """
    dtype = next(iter(params.values())).dtype
    raw = datamodule.train_x
    idx = None if indices is None else torch.as_tensor(indices, dtype=torch.long, device=raw.device)
    n = len(raw) if idx is None else len(idx)
    out = []
    for lo in range(0, n, batch_size):
        chunk = raw[lo : lo + batch_size] if idx is None else raw[idx[lo : lo + batch_size]]
        out.append(predict_logits(module, params, datamodule.transform(chunk, dtype), batch_size))
    if not out:
        return torch.zeros(0, datamodule.num_classes, dtype=dtype, device=raw.device)
    return torch.cat(out)


@torch.no_grad()
def per_client_accuracy(
    module: nn.Module,
    params: dict[str, Tensor],
    datamodule: Any,
    split: Literal["train", "holdout"] = "train",
) -> Tensor:
    """Accuracy of one model on each client's own data, ``Y(D_c)``, as a float64 tensor ``[K]``.

    Args:
        module: The model (its own parameters are not used or changed).
        params: The parameters to evaluate.
        datamodule: The federated datamodule (set up, on the module's device).
        split: ``train``: each client's training samples; ``holdout``: each client's held-out
            samples (``holdout_fraction > 0``). A client without samples in the split gets NaN.

    Returns:
        ``acc[c]`` = share of client ``c``'s samples that the model classifies correctly.
    """
    if split not in ("train", "holdout"):
        raise ValueError(f"split={split!r}: choose train or holdout")
    parts = datamodule.client_indices if split == "train" else datamodule.holdout_indices
    k = len(parts)
    correct = (sample_logits(module, params, datamodule).argmax(-1) == datamodule.train_y).double().cpu()
    owner = torch.full((len(correct),), -1, dtype=torch.long)
    for c, idx in enumerate(parts):
        owner[idx.cpu()] = c
    used = owner >= 0
    hits = torch.zeros(k, dtype=torch.float64).index_add_(0, owner[used], correct[used])
    counts = torch.zeros(k, dtype=torch.float64).index_add_(
        0, owner[used], torch.ones(int(used.sum()), dtype=torch.float64)
    )
    return hits / counts
