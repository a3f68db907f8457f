"""``--trainer.gradient_clip_val`` through the CLI: fit, unlearn and audit bit-exact; bad settings refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _cli import cli
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ["--config", str(ROOT / "configs" / "digits.yaml"), "--trainer.enable_progress_bar", "false"]


# 8 clients, at most 3 rounds a shard (rounds: auto's cap): the clipping and its exactness do not
# depend on the size, and the shipped 32 clients with a 30-round cap took about 30 s a fit.
SMALL = ["--data.num_clients", "8", "--trainer.algorithm.max_rounds", "3"]


def _fit(root: Path, *extra: str) -> Path:
    code, out, err = cli(["fit", *DIGITS, *SMALL, "--trainer.default_root_dir", str(root), *extra])
    assert code == 0, err
    return Path(re.search(r"run directory: (\S+)", out).group(1))


def test_clipped_fit_unlearn_and_audit_are_bit_exact(tmp_path):
    run = _fit(tmp_path / "clip", "--trainer.gradient_clip_val", "0.5")
    plain = _fit(tmp_path / "plain")
    clipped, unclipped = (
        load_file(str(run / "model.safetensors")),
        load_file(str(plain / "model.safetensors")),
    )
    assert any((clipped[k] - unclipped[k]).abs().max() > 1e-3 for k in clipped)  # the clipping acted
    code, out, err = cli(["unlearn", "--ckpt_path", str(run), "--clients", "[2, 7]"])
    assert code == 0, err
    code, out, err = cli(["audit", "--ckpt_path", str(run)])
    assert code == 0 and "bit-exact" in out, out + err
    recorded = json.loads((run / "cache" / "FINGERPRINT").read_text())["body"]["gradient_clip"]
    assert recorded == {"val": 0.5, "algorithm": "norm", "hook": False}


def test_another_clipping_is_refused_on_unlearn(tmp_path):
    run = _fit(tmp_path, "--trainer.gradient_clip_val", "0.5")
    code, _, err = cli(
        ["unlearn", "--ckpt_path", str(run), "--clients", "[2]", "--trainer.gradient_clip_val", "1.0"]
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "another gradient clipping" in err, err


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--trainer.gradient_clip_val", "-0.5"],
            "trainer.gradient_clip_val=-0.5: must be a finite number >= 0",
        ),
        (["--trainer.gradient_clip_algorithm", "l1"], "gradient_clip_algorithm"),
    ],
)
def test_bad_clipping_is_one_line_exit_2_and_writes_nothing(tmp_path, flags, message):
    code, _, err = cli(["fit", *DIGITS, "--trainer.default_root_dir", str(tmp_path / "runs"), *flags])
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert not (tmp_path / "runs").exists()
