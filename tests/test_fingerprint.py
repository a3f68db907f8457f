"""A run is retrained only with fit's client optimizer, also where no constructor argument records it."""

from __future__ import annotations

import json

import pytest
import torch
from _models import Plain
from _tiny import tiny_data, tiny_trainer

from fedshard_lightning.errors import CacheError


class AttributeLR(Plain):
    """Keeps its rate in an attribute, without save_hyperparameters: no init argument is recorded."""

    def __init__(self, lr: float = 0.05, gamma: float | None = None) -> None:
        super().__init__()
        self.lr, self.gamma = lr, gamma

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)
        if self.gamma is None:
            return opt
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=self.gamma)]


def _fresh(**kw):
    torch.manual_seed(0)
    return AttributeLR(**kw), tiny_data()


@pytest.mark.exactness
def test_fit_records_the_optimizer_and_unlearn_refuses_another(tmp_path):
    tr = tiny_trainer(tmp_path, vectorize="always")
    tr.fit(*_fresh(gamma=0.5))
    run = tr.run_dir
    body = json.loads((run / "cache" / "FINGERPRINT").read_text())["body"]["optimizer"]
    assert body["class"] == "SGD" and body["groups"][0][1]["lr"] == 0.05
    assert body["round_lrs"] == [[0.05], [0.025], [0.0125], [0.00625]]  # StepLR(gamma 0.5), per round
    before = sorted(p.name for p in (run / "cache").rglob("*"))
    where_lr = r"optimizer.groups.0.1.lr: 0.05 in the run, 0.5 now"
    for changed, where in (
        ({"lr": 0.5}, where_lr),
        ({"gamma": 0.9}, r"optimizer.round_lrs.1.0: 0.025 in the run"),
    ):
        for command in ("unlearn", "audit"):
            args = (str(run), [3]) if command == "unlearn" else (str(run),)
            with pytest.raises(CacheError, match=rf"another client optimizer \({where}"):
                getattr(tiny_trainer(tmp_path, vectorize="always"), command)(
                    *_fresh(**{"gamma": 0.5, **changed}), *args
                )
    with pytest.raises(CacheError, match=r"another client optimizer \(optimizer.groups"):
        tiny_trainer(tmp_path, vectorize="always").fit(*_fresh(lr=0.5, gamma=0.5), ckpt_path=str(run))
    assert sorted(p.name for p in (run / "cache").rglob("*")) == before  # nothing was written
    tiny_trainer(tmp_path, vectorize="always").unlearn(*_fresh(gamma=0.5), str(run), [3])
    res = tiny_trainer(tmp_path, vectorize="always").audit(*_fresh(gamma=0.5), str(run), tolerance=0.0)
    assert res["max_abs_diff"] == 0.0


@pytest.mark.exactness
def test_a_run_without_the_record_is_still_accepted(tmp_path):
    """Runs fitted before the optimizer was recorded keep working (the fingerprint hash is unchanged)."""
    tr = tiny_trainer(tmp_path, vectorize="always")
    tr.fit(*_fresh())
    path = tr.run_dir / "cache" / "FINGERPRINT"
    recorded = json.loads(path.read_text())
    del recorded["body"]["optimizer"]
    path.write_text(json.dumps(recorded))
    report = tiny_trainer(tmp_path, vectorize="always").unlearn(*_fresh(), str(tr.run_dir), [3])
    assert report["client_steps"] > 0


@pytest.mark.exactness
def test_unlearn_with_another_setting_names_it(tmp_path):
    """Not only two hashes: the setting that differs from the run's, as a resume names it."""
    tr = tiny_trainer(tmp_path, vectorize="always")
    tr.fit(*_fresh())
    torch.manual_seed(0)
    other = tiny_data(rho=0.3)
    with pytest.raises(
        CacheError,
        match=r"another config or dataset \(data_settings.init_args.rho: 0.5 in the run, 0.3 now\)",
    ):
        tiny_trainer(tmp_path, vectorize="always").unlearn(AttributeLR(), other, str(tr.run_dir), [3])


@pytest.mark.exactness
def test_the_readable_body_hashes_to_the_fingerprint_runs_were_made_with(tmp_path):
    """The body is computed once per run and hashed without its readable extras: old runs still load."""
    import hashlib

    from fedshard_lightning.run.fingerprint import (
        body_fingerprint,
        fingerprint,
        fingerprint_body,
        readable_body,
    )

    tr = tiny_trainer(tmp_path, vectorize="always")
    tr.fit(*_fresh())
    args = (tr.module, tr.datamodule, tr.algorithm, tr.seed)
    old = fingerprint_body(*args)  # the formula of the runs made before the body was kept
    want = hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()[:32]
    assert body_fingerprint(readable_body(*args)) == fingerprint(*args) == want == tr.store.fingerprint
