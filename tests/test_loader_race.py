"""Two processes converting the embedded GGUF at once (a fresh cache, two kvcap commands):
the one that loses the rename uses the winner's complete directory instead of failing."""

from __future__ import annotations

import json

import pytest

from kvcap.models.loader import publish_dir


def _staged(tmp_path, name="ours"):
    d = tmp_path / f".staging-{name}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"by": name}))
    return d


def test_publish_moves_the_staging_dir_into_place(tmp_path):
    out = tmp_path / "smol"
    publish_dir(_staged(tmp_path), out)
    assert json.loads((out / "config.json").read_text()) == {"by": "ours"}
    assert [p.name for p in tmp_path.iterdir()] == ["smol"]


def test_losing_the_race_keeps_the_winner(tmp_path):
    out = tmp_path / "smol"
    publish_dir(_staged(tmp_path, "winner"), out)
    publish_dir(_staged(tmp_path, "loser"), out)  # the rename fails: the target is not empty
    assert json.loads((out / "config.json").read_text()) == {"by": "winner"}
    assert [p.name for p in tmp_path.iterdir()] == ["smol"]


def test_an_incomplete_target_still_fails(tmp_path):
    out = tmp_path / "smol"
    out.mkdir()
    (out / "partial.bin").write_text("x")  # not a finished conversion (no config.json)
    with pytest.raises(OSError):
        publish_dir(_staged(tmp_path), out)
