"""After a crash: do ``test``, ``unlearn`` and ``audit`` agree on one model, the cache's, and the reference?

Used by ``scripts/crash_trials.py`` (killed fits), ``scripts/crash_unlearn.py`` (killed unlearns)
and their slow tests. Everything runs in-process through ``cli.main``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from _reliability_helpers import cli, error_lines
from safetensors.torch import load_file

from fedshard_lightning.flcache import FLCache


def cache_model(run: Path) -> dict[str, torch.Tensor]:
    """The current cache version's final model (FedShard: row 0 of the last stage's stack), verified."""
    cache = FLCache(run / "cache")
    manifest = cache.manifest()
    stack = cache.stack(f"stage_{manifest['stages_done']}", manifest=manifest)
    return {k: v[0] for k, v in stack.items()}


def model_matches_cache(run: Path) -> bool:
    """Whether ``model.safetensors`` holds exactly the cache's current model (the deployed model is not stale)."""
    path = run / "model.safetensors"
    if not path.is_file():
        return False
    on_disk = load_file(str(path))
    return all(
        k in on_disk and on_disk[k].dtype == v.dtype and torch.equal(on_disk[k], v)
        for k, v in cache_model(run).items()
    )


@dataclass
class Agreement:
    """What the readers and writers said about one run after a crash."""

    test: str = ""
    stale: bool = False  # test ran, yet model.safetensors differs from the cache's current model
    unlearn: str = ""
    identical: bool = False  # the model after the unlearn equals the uninterrupted reference byte for byte
    audit: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every step passed, nothing stale, bit-identical."""
        return (
            self.test == "ok"
            and not self.stale
            and self.unlearn == "ok"
            and self.identical
            and self.audit == "ok"
        )


def _run(args: list[str]) -> str:
    code, _, err = cli(args)
    if code == 0:
        return "ok"
    lines = error_lines(err)
    return f"exit {code}: {lines[-1] if lines else ''}"


def agree(run: Path, config: Path, clients: str, reference: bytes) -> Agreement:
    """Run ``test``, ``unlearn --clients CLIENTS`` and ``audit`` on a run; say whether they agree.

    After ``test`` the model must be the cache's; after the unlearn it must equal ``reference``
    byte for byte and the cache's; ``audit`` must pass and leave the model as it is.
    """
    a = Agreement()
    base = ["--config", str(config), "--ckpt_path", str(run)]
    a.test = _run(["test", *base])
    a.stale = not model_matches_cache(run)
    a.unlearn = _run(["unlearn", *base, "--clients", clients])
    model = (run / "model.safetensors").read_bytes() if (run / "model.safetensors").is_file() else b""
    a.identical = model == reference and model_matches_cache(run)
    a.audit = _run(["audit", *base])
    if (run / "model.safetensors").read_bytes() != model:
        a.audit += " (rewrote model.safetensors)"
    return a
