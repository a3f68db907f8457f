"""The numerical environment: recorded by fit, reproduced by unlearn and audit, named on failure."""

from __future__ import annotations

import json

import pytest
import torch
from _tiny import tiny_data, tiny_model, tiny_trainer

from fedshard_lightning.data import DigitsDataModule
from fedshard_lightning.errors import ConfigError
from fedshard_lightning.models import MLP
from fedshard_lightning.unlearning import FedShard


def _fresh():
    return tiny_model(MLP), tiny_data((6,), per_client=12, classes=3, partition="iid")


def _trainer(root, **kw):
    return tiny_trainer(root, vectorize="always", **kw)


def test_fit_records_unlearn_and_audit_reproduce_threads(tmp_path, capsys):
    tr = _trainer(tmp_path, num_threads=1)
    tr.fit(*_fresh())
    env = json.loads((tr.run_dir / "numerics.json").read_text())
    assert env["threads"] == 1 and env["engine_mode"] == "stacked" and env["batch_invariant"] is True
    assert env["kernel"] == "fx+chain" and env["invariant_block"] is None and env["device"] == "cpu"
    assert env["tf32"] == [False, False]  # a CUDA-only switch: never on for a CPU run
    _trainer(tmp_path, num_threads=1).unlearn(*_fresh(), str(tr.run_dir), [3])
    torch.set_num_threads(2)
    try:
        res = _trainer(tmp_path).audit(*_fresh(), str(tr.run_dir))  # with fit's count, reproduced
        assert torch.get_num_threads() == 2  # and the caller's count given back afterwards
    finally:
        torch.set_num_threads(1)
    out = capsys.readouterr().out
    assert "warning: numerics: threads: fit used 1, this process had 2; using 1" in out
    assert res["max_abs_diff"] == 0.0 and "audit PASSED, bit-exact" in out
    # The kernel is chosen at the first stacked call: not yet decided is not a difference.
    assert "numerics: kernel" not in out and "has None" not in out, out


def test_failed_audit_names_first_shard_and_likely_cause(tmp_path, capsys, monkeypatch):
    tr = _trainer(tmp_path)
    tr.fit(*_fresh())
    _trainer(tmp_path).unlearn(*_fresh(), str(tr.run_dir), [3])
    env = json.loads((tr.run_dir / "numerics.json").read_text())
    env["torch"] = "0.0.0-elsewhere"
    (tr.run_dir / "numerics.json").write_text(json.dumps(env))
    original = FedShard.audit_compare

    def tampered(self, state, reference, tolerance, steps):
        # a stage-2 model that differs from its replay, in memory only
        first = next(iter(state.models[1]))
        state.models[1][first][0] += 1e-3
        return original(self, state, reference, tolerance, steps)

    monkeypatch.setattr(FedShard, "audit_compare", tampered)
    res = _trainer(tmp_path).audit(*_fresh(), str(tr.run_dir))  # returned: no SystemExit from Python
    assert res["passed"] is False and res["max_abs_diff"] == pytest.approx(1e-3, rel=1e-4)
    out = capsys.readouterr().out
    assert "audit FAILED" in out
    assert "first difference: stage 2 shard 0 (max|diff| = 1.000e-03)" in out
    assert "likely cause: torch: fit ran with '0.0.0-elsewhere'" in out


def test_audit_on_another_path_names_it(tmp_path, capsys):
    """fit stacked, audit on the loop (``trainer.vectorize: never``): the path is named, at start and as the cause."""
    tr = _trainer(tmp_path)
    tr.fit(*_fresh())
    _trainer(tmp_path).unlearn(*_fresh(), str(tr.run_dir), [3])
    capsys.readouterr()
    # the hand-written stacked kernels round otherwise than the loop
    assert not tiny_trainer(tmp_path, vectorize="never").audit(*_fresh(), str(tr.run_dir))["passed"]
    out = capsys.readouterr().out
    line = "engine_mode: fit ran with 'stacked', this process has 'loop' (trainer.vectorize"
    assert f"warning: numerics: {line}" in out
    assert "audit FAILED" in out and f"likely cause: {line}" in out


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True])
def test_audit_tolerance_is_checked_before_any_replay(tmp_path, bad):
    with pytest.raises(ConfigError, match="tolerance="):
        _trainer(tmp_path).audit(*_fresh(), str(tmp_path / "missing"), tolerance=bad)


def test_num_threads_is_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.num_threads"):
        _trainer(tmp_path, num_threads=0)


def _model_bytes(module: torch.nn.Module) -> list[bytes]:
    return [v.detach().numpy().tobytes() for _, v in sorted(module.state_dict().items())]


def test_calls_give_the_caller_its_rng_stream_and_threads_back(tmp_path):
    """A notebook's ``torch.rand`` after fit/test/unlearn/audit draws what it would have without them."""
    torch.manual_seed(123)
    expected = torch.rand(3)  # the reference: the same user code with no trainer call in between
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for call, seed in (("fit", 123), ("fit", 7), ("test", 123), ("unlearn", 123), ("audit", 123)):
            model, data = _fresh()  # tiny_model seeds torch itself: built before the caller's seed
            if call == "fit":  # lazy layers: the model comes from trainer.seed, not the caller's stream
                model = MLP(hidden=(16,), lr=0.1, momentum=0.5)
                torch.manual_seed(seed)
                tr = _trainer(tmp_path, num_threads=1)
                tr.fit(model, data)
                runs.append((tr.run_dir, _model_bytes(model)))
            else:
                torch.manual_seed(seed)
                args = (model, data, str(runs[0][0]), *([[3]] if call == "unlearn" else []))
                getattr(_trainer(tmp_path), call)(*args)
            if seed == 123:
                assert torch.equal(torch.rand(3), expected), call
            assert torch.get_num_threads() == 2, call
        assert runs[0][1] == runs[1][1]  # whatever the caller's stream was
        assert json.loads((runs[0][0] / "numerics.json").read_text())["threads"] == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_half_precision_audit_is_bit_exact_else_names_the_dtype(tmp_path, capsys, monkeypatch, precision):
    # The CPU's half-precision add_(g, alpha) rounds a tensor's vector body and its scalar tail
    # differently, so stacked SGD updated a client by its row in the call (1e-3 on digits) and this
    # audit failed (1.2e-2 in bf16); the engine now steps each client's row alone
    # (engine/row_optim.py). Reference: the same run in float32 audits bit-exact
    # (test_fit_records_unlearn_and_audit_reproduce_threads).
    def fresh():
        torch.manual_seed(0)
        return MLP(hidden=[16], lr=0.1), DigitsDataModule(
            num_clients=8, partition="dirichlet", rho=0.5, min_client_size=10, seed=0
        )

    def audited(name):
        def trainer():
            return tiny_trainer(tmp_path, vectorize="always", precision=precision, run_name=name)

        trainer().fit(*fresh())
        trainer().unlearn(*fresh(), str(tmp_path / name), [3])
        return trainer().audit(*fresh(), str(tmp_path / name))

    result = audited("half")
    assert result["passed"] and result["max_abs_diff"] == 0.0
    # With the stacked optimizer back, the audit fails and names the dtype (it used to blame
    # "no difference in the recorded numerical environment").
    monkeypatch.setattr("fedshard_lightning.engine.local.needs_rows", lambda *a: False)
    capsys.readouterr()
    assert not audited("stacked_opt")["passed"]  # returned to Python; the CLI exits 1
    out = capsys.readouterr().out
    assert "audit FAILED" in out and "no difference in the recorded numerical environment" not in out
    assert f"likely cause: dtype {'torch.bfloat16' if precision == 'bf16-true' else 'torch.float16'}" in out


def test_unlearn_and_audit_use_fits_compile_setting(tmp_path, capsys):
    # The compiled step rounds differently from the eager one in float32 (1.8e-7 on digits), so
    # an unlearn with another trainer.compile than fit's mixed the two and its audit failed; now it
    # uses fit's, like the thread count. Reference: fit's recorded setting and a bit-exact audit.
    tr = _trainer(tmp_path, compile=False)
    tr.fit(*_fresh())
    assert json.loads((tr.run_dir / "numerics.json").read_text())["compile"] is False
    un = _trainer(tmp_path, compile=True)
    un.unlearn(*_fresh(), str(tr.run_dir), [3])
    assert un.compile is False and un.algorithm.engine.local.compiled is False
    res = _trainer(tmp_path, compile=True).audit(*_fresh(), str(tr.run_dir))
    out = capsys.readouterr().out
    assert "warning: numerics: compile: fit ran with False, this process had True; using fit's" in out
    assert res["max_abs_diff"] == 0.0 and "audit PASSED, bit-exact" in out


def _edit_training_samples(monkeypatch) -> None:
    """The same labels and settings, other feature values: what an edited data file gives."""
    from fedshard_lightning.data import SyntheticDataModule

    original = SyntheticDataModule.load_split

    def edited(self, train):
        x, y = original(self, train)
        return (x + 0.5, y) if train else (x, y)

    monkeypatch.setattr(SyntheticDataModule, "load_split", edited)


def test_other_training_samples_are_refused_before_any_retraining(tmp_path, monkeypatch):
    """The hashed fingerprint covers labels and partition; the recorded values digest covers the rest.

    Before, an edited data file with the same labels was unlearned on in silence and the audit
    then failed. Reference: the digest of the samples as fit saw them, recomputed with hashlib.
    """
    import hashlib

    from fedshard_lightning.errors import CacheError

    tr = _trainer(tmp_path)
    model, data = _fresh()
    tr.fit(model, data)
    x = data.train_x.cpu().contiguous().numpy()
    want = hashlib.sha256(f"{x.dtype}{x.shape}".encode() + x.tobytes()).hexdigest()[:32]
    recorded = json.loads((tr.run_dir / "cache" / "FINGERPRINT").read_text())["body"]["data_values"]
    assert recorded == want
    _edit_training_samples(monkeypatch)
    for call, args in (("unlearn", ([3],)), ("audit", ()), ("test", ())):
        with pytest.raises(
            CacheError, match=r"was trained with other training samples .* use the data files"
        ):
            getattr(_trainer(tmp_path), call)(*_fresh(), str(tr.run_dir), *args)
    assert not (tr.run_dir / "unlearning").exists()


def test_audit_of_a_run_without_a_values_digest_names_the_samples_as_a_cause(tmp_path, capsys, monkeypatch):
    """Runs fitted before the digest was recorded are not refused; their failed audit names the data."""
    tr = _trainer(tmp_path)
    tr.fit(*_fresh())
    _trainer(tmp_path).unlearn(*_fresh(), str(tr.run_dir), [3])
    path = tr.run_dir / "cache" / "FINGERPRINT"
    recorded = json.loads(path.read_text())
    del recorded["body"]["data_values"]
    path.write_text(json.dumps(recorded))
    _edit_training_samples(monkeypatch)
    assert not _trainer(tmp_path).audit(*_fresh(), str(tr.run_dir))["passed"]
    out = capsys.readouterr().out
    assert "audit FAILED" in out
    assert (
        "likely cause: no difference in the recorded numerical environment: were the cache, the model or the "
        in out
    )
    assert (
        "training samples changed (the run's fingerprint covers the data's labels and partition, not the sample "
        in out
    )


def test_fit_records_the_blas_mode_and_another_mode_is_named(tmp_path, capsys):
    from fedshard_lightning.engine.blas import blas_mode

    tr = _trainer(tmp_path, num_threads=1)
    tr.fit(*_fresh())
    path = tr.run_dir / "numerics.json"
    env = json.loads(path.read_text())
    assert env["blas_mode"] == blas_mode() == ("AUTO" if torch.backends.mkl.is_available() else "none")
    env["blas_mode"] = "OFF"  # as if fit had run under MKL's default dispatch
    path.write_text(json.dumps(env))
    capsys.readouterr()
    _trainer(tmp_path, num_threads=1).audit(*_fresh(), str(tr.run_dir))
    out = capsys.readouterr().out
    assert f"numerics: blas_mode: fit ran with 'OFF', this process has '{blas_mode()}'" in out, out
