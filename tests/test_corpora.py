"""Corpora: determinism, calibration/evaluation disjointness, token budgets, provenance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcap.errors import ConfigError
from kvcap.eval import corpora, sources, synth


@pytest.fixture(scope="module")
def both_splits(tokenizer):
    cal = corpora.build_shards(tokenizer, None, 40_000, "calibration", 256, progress=False)
    ev = corpora.build_shards(tokenizer, None, 20_000, "evaluation", 256, progress=False)
    return cal, ev


def test_record_hash_is_sha256_of_int32_ids():
    import hashlib
    import struct

    expect = hashlib.sha256(struct.pack("<3i", 1, 2, 70000)).hexdigest()
    assert corpora.record_hash([1, 2, 70000]) == expect
    assert corpora.record_hash([1, 2]) != corpora.record_hash([2, 1])


def test_deterministic(tokenizer, both_splits):
    cal, _ = both_splits
    again = corpora.build_shards(tokenizer, None, 40_000, "calibration", 256, progress=False)
    assert [s.name for s in again] == [s.name for s in cal]
    for a, b in zip(again, cal, strict=True):
        assert a.records == b.records
        assert a.provenance == b.provenance


def test_splits_disjoint(both_splits):
    cal, ev = both_splits
    cal_h = {h for s in cal for h in s.hashes()}
    ev_h = {h for s in ev for h in s.hashes()}
    assert cal_h and ev_h and not cal_h & ev_h
    # Disjoint at the document level too, not only per record.
    def docs(shards):
        return {p.get("doc_id") or p.get("from") for s in shards for p in s.provenance} - {None}
    assert not docs(cal) & docs(ev)


def test_budget_and_record_sizes(both_splits):
    cal, ev = both_splits
    assert sum(s.num_tokens for s in cal) == 40_000
    assert sum(s.num_tokens for s in ev) == 20_000
    for s in cal + ev:
        assert s.records, s.name
        assert all(corpora.MIN_RECORD_TOKENS <= len(r) <= 256 for r in s.records)


def test_provenance_present(both_splits):
    cal, ev = both_splits
    for s in cal + ev:
        assert len(s.provenance) == len(s.records)
        for p, r in zip(s.provenance, s.records, strict=True):
            assert p["tokens"] == len(r)
            assert "source" in p or "generator" in p
            if p.get("source") in ("common-licenses", "gettext"):
                assert Path(p["path"]).exists()


def test_builtin_shards_present(both_splits):
    cal, _ = both_splits
    names = {s.name for s in cal}
    assert {"prose", "code", "chat", "tool_json"} <= names
    assert ("chinese" in names) == (corpora.unavailable_reason("chinese") is None)


def test_chat_records_use_template(tokenizer, both_splits):
    cal, _ = both_splits
    chat = next(s for s in cal if s.name == "chat")
    text = tokenizer.decode(chat.records[0])
    assert text.startswith("<|im_start|>system")


def test_tool_json_splits_never_coincide():
    a, _ = synth.tool_conversation(0, "calibration", 7)
    b, _ = synth.tool_conversation(0, "evaluation", 7)
    assert a[0]["content"][:20] != b[0]["content"][:20]
    call = json.loads(a[2]["content"])
    assert {"name", "arguments", "id"} <= set(call)


def test_split_of_is_group_stable():
    docs = sources.code_documents()
    by_group: dict[str, set[str]] = {}
    for d in docs:
        by_group.setdefault(d.group, set()).add(sources.split_of("code", d.group))
    assert all(len(v) == 1 for v in by_group.values())
    assert {"calibration", "evaluation"} == set().union(*by_group.values())


def test_file_corpus_and_manifest(tokenizer, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    (shard,) = corpora.build_shards(tokenizer, [str(f)], 1000, "calibration", 128,
                                    progress=False)
    assert shard.name == f"file:{f.resolve()}"
    assert shard.num_tokens == 1000
    assert shard.provenance[0]["source"] == "file" and len(shard.provenance[0]["sha256"]) == 64
    out = corpora.write_manifest(tmp_path / "m.json", [shard], tokenizer, "calibration")
    data = json.loads(out.read_text())
    assert data["shards"][0]["record_hashes"] == shard.hashes()
    assert data["total_tokens"] == 1000 and "prose" in data["skipped"]
    assert corpora.manifest_hashes(out) == set(shard.hashes())


def test_file_corpus_must_be_utf8(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\u00e9 au lait ".encode("latin-1") * 50)
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 3"):
        corpora.resolve_names([str(f)])


def test_exclude_hashes(tokenizer):
    (first,) = corpora.build_shards(tokenizer, ["prose"], 2000, "evaluation", 128, progress=False)
    (second,) = corpora.build_shards(tokenizer, ["prose"], 2000, "evaluation", 128,
                                     exclude_hashes=set(first.hashes()), progress=False)
    assert not set(first.hashes()) & set(second.hashes())


def test_bad_names():
    with pytest.raises(ConfigError, match="unknown corpus"):
        corpora.resolve_names(["no-such-corpus"])
    with pytest.raises(ConfigError, match="repeat"):
        corpora.resolve_names(["prose", "prose"])
