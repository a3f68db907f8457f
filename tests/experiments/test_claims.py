"""The claims table: verdicts from the stated rules on synthetic results, a reason in every row."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedshard_lightning.experiments.claims import FAILS, HOLDS, MISSING, PARTLY, RULES, build_claims, claims
from fedshard_lightning.experiments.mia_report import write_mia_summary
from fedshard_lightning.experiments.mia_shadow import MIAScores

VERDICTS = {HOLDS, PARTLY, FAILS, MISSING}


def _row(method, seed, **kw):
    base = {
        "method": method,
        "seed": seed,
        "num_clients": 64,
        "merge_rate": 2 if method.startswith("fedshard") else None,
        "stages": 6 if method.startswith("fedshard") else None,
        "leaving_together": 4,
    }
    return {**base, **kw}


def _compare(seeds=(0, 1, 2), fs_me=1.0, fs_mp=5.0, fs_t=1.0):
    rows = []
    for s in seeds:
        rows += [
            _row("fedshard", s, M_e_steps=fs_me, M_p=fs_mp, t=fs_t, client_steps=1000.0, r2_steps=3.0),
            _row("fedavg", s, M_e_steps=1.0, M_p=6.0, t=2.0 + 0.1 * s, client_steps=4000.0, r2_steps=1.0),
            _row("fats", s, M_e_steps=3.0, M_p=7.0, t=3.0, client_steps=3900.0, r2_steps=1.2),
        ]
    return {"seeds": list(seeds), "rows": rows}


def _scores(rng, shift, n=300):
    return MIAScores(rng.normal(shift, 1, n), rng.normal(0, 1, n), 0.6)


def _mia(tmp_path, before=1.0, fs_after=0.0, fa_after=0.0, seeds=2):
    rng = np.random.default_rng(0)
    arrays = {
        m: [{"before": _scores(rng, before), "after": _scores(rng, after)} for _ in range(seeds)]
        for m, after in (("fedshard", fs_after), ("fedavg", fa_after))
    }
    return write_mia_summary(tmp_path / "mia.json", arrays, "fedshard", num_bootstrap=200)


def _ablation(fs=0.95, naive=0.5, fa=0.95):
    rows = []
    for s in (0, 1, 2):
        d = 0.002 * s
        rows += [
            {"method": "fedshard", "seed": s, "test_accuracy": fs + d},
            {"method": "fedshard (rounds: fixed)", "seed": s, "test_accuracy": 0.9 + d},
            {"method": "fedshard (merge: random, rounds: fixed)", "seed": s, "test_accuracy": naive + d},
            {"method": "fedavg", "seed": s, "test_accuracy": fa + 0.001 * (s % 2)},
        ]
    return {"seeds": [0, 1, 2], "rows": rows}


CASCADE = {"summary": {"fedshard": 0, "fedavg": 0, "federaser": 4}, "settings": {"seed": 0}}
POISON = {"summary": {"fedshard": 0.0, "fedavg": 0.0, "federaser": 0.1}, "settings": {"threshold": 0.1}}


def test_every_row_has_a_verdict_and_a_reason(tmp_path):
    rows = build_claims(_compare(), _mia(tmp_path), _ablation(), CASCADE, POISON)
    assert [r.claim for r in rows] == list(RULES)
    for r in rows:
        assert r.verdict in VERDICTS and r.reason and r.paper
    got = {r.claim: r.verdict for r in rows}
    assert got == {
        "E.F. (M_e)": HOLDS,  # FS/FT = 1/3, FS/FA = 1
        "P.F. (M_p)": HOLDS,  # FS lowest
        "MIA": HOLDS,  # before: power; after: both at 0.5
        "speed vs FA": HOLDS,  # 2.0-2.2x >= 1.3
        "speed vs FT": HOLDS,
        "ablation": HOLDS,
        "cascaded leaving": HOLDS,
        "uf-DPA": HOLDS,
        "r1": HOLDS,  # FA/FS = 4 >= r1 = 0.5 * 64/63 * 6 = 3.05
        "r2": HOLDS,  # 3 in [1, 4]
    }


def test_verdicts_follow_the_numbers(tmp_path):
    rows = {
        r.claim: r
        for r in build_claims(
            _compare(fs_me=4.0, fs_mp=8.0, fs_t=1.8),
            _mia(tmp_path, fs_after=1.0),
            _ablation(fs=0.8, naive=0.5, fa=0.95),
            {"summary": {"fedshard": 3, "fedavg": 1}},
            {"summary": {"fedshard": 0.0, "fedavg": 0.0, "federaser": 0.0}},
        )
    }
    assert rows["E.F. (M_e)"].verdict == FAILS  # above FT in every seed
    assert rows["P.F. (M_p)"].verdict == FAILS  # worst of three
    assert rows["MIA"].verdict == FAILS  # FS still leaks after unlearning: the paired CI excludes 0
    assert rows["speed vs FA"].verdict == PARTLY  # 1.1-1.2x: faster, below 1.3
    assert rows["ablation"].verdict == PARTLY  # beats naive, below FedAvg
    assert rows["cascaded leaving"].verdict == FAILS  # more than FA
    assert rows["uf-DPA"].verdict == PARTLY  # nobody poisoned, no contrast
    assert "r1 = 3.05" in rows["r1"].ours  # (R-1)/R K/(K-1) P = 0.5 * 64/63 * 6


def test_mia_without_power_is_not_measured(tmp_path):
    rows = build_claims(_compare(), _mia(tmp_path, before=0.0), None, None, None)
    mia = next(r for r in rows if r.claim == "MIA")
    assert mia.verdict == MISSING and "no power" in mia.reason
    assert {r.claim: r.verdict for r in rows}["ablation"] == MISSING


def test_command_pools_seed_folders_and_takes_a_fedshard_label(tmp_path, capsys):
    work = tmp_path / "work"
    label = "fedshard (rounds: stage_a2)"
    for s in (0, 1):
        d = work / f"compare-s{s}"
        d.mkdir(parents=True)
        comp = _compare(seeds=(s,))
        for r in comp["rows"]:
            r["method"] = label if r["method"] == "fedshard" else r["method"]
        (d / "compare.json").write_text(json.dumps(comp))
        rng = np.random.default_rng(s)
        write_mia_summary(
            d / "mia.json",
            {m: [{"before": _scores(rng, 1.0), "after": _scores(rng, 0.0)}] for m in (label, "fedavg")},
            label,
            num_bootstrap=50,
        )
    out = tmp_path / "claims.md"
    res = claims(out=str(out), workdir=str(work), fedshard=label, run_missing=False, mia_bootstrap=50)
    text = out.read_text()
    assert "seeds [0, 1]" in text and f'--fedshard "{label}"' in text
    verdicts = {r["claim"]: r["verdict"] for r in res["rows"]}
    assert verdicts["MIA"] == HOLDS and "2 seed(s)" in text
    assert verdicts["cascaded leaving"] == MISSING  # not run: a verdict and a reason all the same
    for line in text.splitlines()[2:12]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 5 and cells[3].strip("*") in VERDICTS and cells[4]


@pytest.mark.parametrize("fs_steps, verdict", [(1000.0, HOLDS), (2000.0, PARTLY), (5000.0, FAILS)])
def test_r1_rule(fs_steps, verdict):
    comp = _compare()
    for r in comp["rows"]:
        if r["method"] == "fedshard":
            r["client_steps"] = fs_steps
    r1 = next(r for r in build_claims(comp, None, None, None, None) if r.claim == "r1")
    assert r1.verdict == verdict


def test_a_variant_row_is_judged_beside_the_papers(tmp_path):
    variant = "fedshard (merge: a1_path, rounds: stage_a2)"
    comp = _compare(fs_me=4.0)  # the paper's FedShard: above FT's M_e in every seed
    for s in (0, 1, 2):  # the variant: below FT's and equal to FA's; measured (t, M_p) in seed 0 only
        kw = {"t": 1.0, "M_p": 5.0} if s == 0 else {}
        comp["rows"].append(_row(variant, s, M_e_steps=1.0, client_steps=1000.0, r2_steps=3.0, **kw))
    rows = build_claims(comp, None, _ablation(), CASCADE, POISON, [variant, "fedshard"])
    by = {r.claim: r for r in rows}
    ef_v = by[f"E.F. (M_e), FS = {variant} (our variant)"]
    ef_p = by["E.F. (M_e), FS = fedshard as the paper specifies it"]
    assert ef_v.verdict == HOLDS and ef_p.verdict == FAILS
    assert [r.claim for r in rows].index(ef_p.claim) == [r.claim for r in rows].index(ef_v.claim) + 1
    # each row names the seeds its numbers come from
    assert "seeds [0, 1, 2]" in ef_v.ours
    assert "seeds [0]" in by[f"speed vs FA, FS = {variant} (our variant)"].ours
    # the ablation (the paper's A1 + A2), cascade and uf-DPA rows appear once
    assert by["ablation"].verdict == HOLDS and "cascaded leaving" in by and "uf-DPA" in by
    assert len(rows) == 3 + 2 * 7
