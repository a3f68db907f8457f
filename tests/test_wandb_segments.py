"""Which earlier W&B segments a resumed fit may replace: only offline ones not yet uploaded."""

from __future__ import annotations

import json

from fedshard_lightning.loggers.wandb_segments import supersede_fit_segments


def _run(tmp_path, names, synced=()):
    for name in names:
        folder = tmp_path / "wandb_files" / "wandb" / name
        folder.mkdir(parents=True)
        (folder / "run-abc.wandb").write_bytes(b":W&B\x00\x00\x00")
        if name in synced:
            (folder / "run-abc.wandb.synced").write_text("")
    (tmp_path / "wandb.json").write_text(json.dumps({"id": "abc", "fit_segments": list(names)}))
    return tmp_path


def test_earlier_offline_segments_not_uploaded_are_moved_out_of_the_sync_glob(tmp_path):
    """The resumed fit's own segment (recorded last) stays; the interrupted ones move."""
    run = _run(tmp_path, ["offline-run-1-abc", "offline-run-2-abc", "offline-run-3-abc"])
    assert supersede_fit_segments(run, "offline")
    assert [p.name for p in (run / "wandb_files" / "wandb").glob("offline-run-*")] == ["offline-run-3-abc"]
    assert sorted(p.name for p in (run / "wandb_files" / "superseded").iterdir()) == [
        "offline-run-1-abc",
        "offline-run-2-abc",
    ]
    assert json.loads((run / "wandb.json").read_text())["fit_segments"] == ["offline-run-3-abc"]


def test_an_uploaded_or_online_segment_keeps_every_segment_in_place(tmp_path):
    """wandb sync's own marker (``run-ID.wandb.synced``) or an online run: the server has those rows."""
    own = "offline-run-9-abc"
    for names, synced, mode in (
        (["offline-run-1-abc", own], ["offline-run-1-abc"], "offline"),
        (["run-1-abc", own], [], "offline"),
        (["run-1-abc", "run-9-abc"], [], "online"),
    ):
        run = _run(tmp_path / f"{names[0]}-{mode}-{bool(synced)}", names, synced)
        assert not supersede_fit_segments(run, mode)
        assert (run / "wandb_files" / "wandb" / names[0]).is_dir()
