"""The run's FLCache as the trainer uses it: every commit, every load, and the fingerprint check.

Algorithms only say which files their state is (:meth:`Algorithm.cache_files`) and how to read
them back (:meth:`Algorithm.restore_cache`); :class:`RunStore` adds what every manifest carries
(algorithm, fingerprint, init args, the base state, the request log, seed, vectorization mode),
writes ``theta0`` once and shares its blob afterwards, commits (with the algorithm's stacks of
models, :meth:`Algorithm.cache_stacks`, of which only the changed rows are written), and
restores the base state itself, so no algorithm can forget to persist ``unlearned`` or
``total_client_steps``.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fedshard_lightning.errors import CacheError
from fedshard_lightning.flcache.cache import FLCache
from fedshard_lightning.flcache.gc import final_only_error
from fedshard_lightning.flcache.io import atomic_write_json, read_json_object
from fedshard_lightning.flcache.schema import check_schema, schema_of
from fedshard_lightning.init_args import init_args
from fedshard_lightning.run.fingerprint import same_run
from fedshard_lightning.unlearning.base import Algorithm
from fedshard_lightning.unlearning.contract import check_state_json

__all__ = ["RunStore"]


_FIX = (
    "the cache was modified after it was written, or the configured model is not the run's; use the run's "
    "config.yaml, or restore the run directory from a backup"
)


def _differences(a: Any, b: Any, where: str) -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                out += _differences(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):  # e.g. optimizer groups
        return [d for i, (x, y) in enumerate(zip(a, b)) if x != y for d in _differences(x, y, f"{where}.{i}")]
    return [(where or "fingerprint", a, b)]


def first_difference(a: Any, b: Any) -> str:
    """The setting where two fingerprint bodies differ, as ``path: A in the run, B now`` ('' when none).

    A readable setting (``data_settings.init_args.num_clients``) is named before a content hash.
    """
    diffs = _differences(a, b, "")
    if not diffs:
        return ""
    readable = [d for d in diffs if not (isinstance(d[1], str) and len(d[1]) >= 32 and d[1].isalnum())]
    where, x, y = (readable or diffs)[0]
    return f"{where}: {json.dumps(x)[:80]} in the run, {json.dumps(y)[:80]} now"


def _same_tensors(a: Any, b: Any) -> bool:
    """The same tensor objects under the same names (state dicts copy the dict, never the tensors)."""
    return (
        isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    )


def _files_changed(was: Any, body: dict[str, Any]) -> str | None:
    """``NAME: sha256 A in the run, B now`` for the first data file that changed, else None."""
    then = was.get("data_files") if isinstance(was, dict) else None
    now = body.get("data_files")
    if not isinstance(then, dict) or not isinstance(now, dict) or then == now:
        return None
    for name in sorted({*then, *now}):
        if then.get(name) != now.get(name):
            return f"{name}: sha256 {then.get(name) or 'absent'} in the run, {now.get(name) or 'absent'} now"
    return None


class RunStore:
    """FLCache of one run, bound to the configured run's fingerprint.

    Args:
        cache: The run's cache folder.
        fingerprint: The configured run's fingerprint; a cache with another one is refused.
        seed: The training seed (recorded).
        write: Whether this process writes (rank zero); others only read.
        body: :func:`~fedshard_lightning.run.fingerprint.readable_body` of the configured run: a
            refusal names the setting that differs from the run's ``cache/FINGERPRINT``, and
            the client optimizer recorded there must be this one.
    """

    def __init__(
        self,
        cache: FLCache,
        fingerprint: str,
        seed: int,
        write: bool = True,
        body: dict[str, Any] | None = None,
    ) -> None:
        self.cache, self.fingerprint, self.seed, self.write = cache, fingerprint, seed, write
        self.body = json.loads(json.dumps(body or {}, sort_keys=True, default=str))
        self.requests: list[dict[str, Any]] = []
        self.complete_committed = False
        self._theta0: Any = None  # the theta0 object that the current version holds

    def check(self, algorithm_name: str) -> dict[str, Any]:
        """The current manifest, refused when it belongs to another config, data or algorithm."""
        manifest = self.cache.manifest()
        if manifest.get("algorithm") != algorithm_name:
            raise CacheError(
                f"{self.cache.root} was written by algorithm {manifest.get('algorithm')!r}, not "
                f"{algorithm_name!r}; use the config that created the run"
            )
        was = self._recorded_body()
        if not self._same(manifest.get("fingerprint"), was):
            changed = _files_changed(was, self.body)
            if changed is not None:
                raise CacheError(
                    f"{self.cache.root.parent} was fitted on other data files ({changed}); put back the "
                    "files it was fitted on, or fit a new run"
                )
            # A manifest whose fingerprint alone was edited: cache/FINGERPRINT still matches the config.
            what = (first_difference(was, self.body) if was and self.body else "") or (
                f"fingerprint {manifest.get('fingerprint')} in the manifest, {self.fingerprint} for this config"
            )
            raise CacheError(
                f"{self.cache.root} was made with another config or dataset ({what}); use the config that "
                "created the run (its config.yaml)"
            )
        self._same_recorded(was, self.body)
        self.requests = list(manifest.get("requests", []))
        return manifest

    def _same(self, recorded: Any, was: Any) -> bool:
        """Whether a recorded fingerprint is this run's (one fitted before data files were hashed too)."""
        return recorded == self.fingerprint or (bool(self.body) and same_run(recorded, self.body, was))

    def _recorded_body(self) -> dict[str, Any]:
        """The readable body in ``cache/FINGERPRINT`` ({} when absent or damaged: the hash still decides)."""
        body = (read_json_object(self.cache.root / "FINGERPRINT") or {}).get("body")
        return body if isinstance(body, dict) else {}

    def claim(self, resume: bool) -> None:
        """Bind the run folder to this config before training: a resume is checked even before its first commit.

        Args:
            resume: Whether this is ``fit --ckpt_path``.
        """
        path = self.cache.root / "FINGERPRINT"
        body = self.body
        if resume and path.is_file():
            try:
                recorded = json.loads(path.read_bytes())
                fp, was = recorded["fingerprint"], recorded.get("body", {})
            except (OSError, ValueError, KeyError, TypeError):
                raise CacheError(f"{path} is damaged; restore the run directory or start a new run") from None
            changed = _files_changed(was, body)
            if changed is not None and not self._same(fp, was):
                raise CacheError(
                    f"{self.cache.root.parent} was fitted on other data files ({changed}); put back the "
                    "files it was fitted on, or start a new run"
                )
            if not self._same(fp, was):
                raise CacheError(
                    f"{self.cache.root.parent} was started with another config or dataset ({first_difference(was, body)}); "
                    "resume it with its own config.yaml (leave out the changed setting)"
                )
            self._same_recorded(was, body)
        elif self.write and not self.cache.exists() and not path.is_file():
            atomic_write_json(path, {"fingerprint": self.fingerprint, "body": body})

    def _same_recorded(self, was: Any, body: dict[str, Any]) -> None:
        """Refuse another client optimizer or other training samples than fit's, where fit recorded them.

        Runs fitted before a key was recorded have no value for it and are not checked.
        """
        recorded = was if isinstance(was, dict) else {}
        for key, what, fix in (
            (
                "optimizer",
                "another client optimizer",
                "the model settings the run was fitted with (its config.yaml)",
            ),
            (
                "data_values",
                "other training samples (same labels and partition)",
                "the data files it was fitted on",
            ),
            (
                "optimizer_state",
                "another trainer.optimizer_state",
                "the run's own setting (its config.yaml)",
            ),
            (
                "gradient_clip",
                "another gradient clipping (trainer.gradient_clip_val / gradient_clip_algorithm)",
                "the run's own setting (its config.yaml)",
            ),
        ):
            then, now = recorded.get(key), body.get(key)
            if then is not None and now is not None and then != now:
                raise CacheError(
                    f"{self.cache.root.parent} was trained with {what} "
                    f"({first_difference({key: then}, {key: now})}); use {fix}"
                )

    def refuse_final_only(self, command: str) -> None:
        """Stop ``command`` in one line on a run that kept only its final model (an emptied cache)."""
        if self.cache.final_only() is not None:
            raise final_only_error(self.cache.root.parent, command)

    def drop_cache(self, algorithm: Algorithm) -> int:
        """Empty the cache of a complete fit that keeps only its final model; the bytes freed (rank zero)."""
        if not self.write:
            return 0
        note = {
            "enable_checkpointing": False,
            "algorithm": algorithm.name,
            "num_clients": algorithm.num_clients,
            "client_steps": int(algorithm.total_client_steps),
            "complete": True,
        }
        return self.cache.drop(note)

    def commit(
        self, algorithm: Algorithm, label: str, complete: bool, vectorize_mode: str | None
    ) -> str | None:
        """Commit the algorithm's state as a new version (rank zero); return its name.

        Every rank records that a complete state was committed, so all ranks agree on whether
        ``fit`` still owes its final commit (and on the barrier that follows it).
        """
        self.complete_committed = self.complete_committed or bool(complete)
        if not self.write:
            return None
        if algorithm.theta0 is None:
            raise CacheError(f"{algorithm.name}: nothing to commit before the fit has a theta0")
        fields, tensors, reuse = algorithm.cache_files(self.cache)
        check_state_json(algorithm, fields.get("state", {}))
        tensors, reuse = dict(tensors), dict(reuse)
        has_base = self.cache.exists() and "theta0.safetensors" in self.cache.manifest().get("files", {})
        if has_base and _same_tensors(algorithm.theta0, self._theta0):
            reuse["theta0.safetensors"] = "theta0.safetensors"
        else:
            tensors["theta0.safetensors"] = algorithm.theta0
        manifest = {
            "algorithm": algorithm.name,
            "fingerprint": self.fingerprint,
            "hparams": init_args(algorithm)["init_args"],
            "num_clients": algorithm.num_clients,
            "unlearned": sorted(algorithm.unlearned),
            "complete": bool(complete),
            "client_steps": int(algorithm.total_client_steps),
            "requests": self.requests,
            "seed": self.seed,
            "vectorize_mode": vectorize_mode,
            "torch_threads": torch.get_num_threads(),
            **fields,
        }
        stacks = algorithm.cache_stacks(self.cache)
        version = self.cache.commit(
            self.cache.next_name(label), manifest, tensors, reuse=reuse, stacks=stacks
        )
        self._theta0 = algorithm.theta0
        algorithm.committed(self.cache, version)
        return version

    def restore(self, algorithm: Algorithm, device: torch.device, vectorize: str = "auto") -> dict[str, Any]:
        """Check the current version and load the algorithm's state from it; return its manifest.

        With ``vectorize: auto`` the engine takes the kernel path the run was trained with: replays
        must, since the stacked and loop paths agree only to rounding (float32 ~1e-7).
        """
        manifest = self.check(algorithm.name)
        if manifest.get("num_clients") != algorithm.num_clients:
            raise CacheError(f"{self.cache.root}: the cache was made for another number of clients")
        model = schema_of(algorithm.engine.module_params())
        self.cache.row_schema = model  # every stack row is a model: checked as it is loaded
        algorithm.theta0 = self.cache.tensors("theta0.safetensors", device=device, manifest=manifest)
        where = f"{self.cache.path_of('theta0.safetensors', manifest=manifest)} (theta0 of the current cache version)"
        check_schema(algorithm.theta0, model, where, _FIX)
        algorithm.restore_cache(self.cache, manifest, device)
        algorithm.unlearned = [int(c) for c in manifest.get("unlearned", [])]
        algorithm.total_client_steps = int(manifest.get("client_steps", 0))
        self._theta0 = algorithm.theta0
        self.complete_committed = bool(manifest.get("complete"))
        mode = manifest.get("vectorize_mode")
        if vectorize == "auto" and mode in ("stacked", "loop"):
            algorithm.engine.set_mode(mode)
        return manifest
