"""kvcap.bench.provenance: the source digest that ties a benchmark result to the code it ran."""

import shutil
import subprocess

import pytest

from kvcap.bench import provenance


def _package(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "kvcap"


def test_digest_depends_on_sources_only(tmp_path):
    files = {"kvcap/__init__.py": "x = 1\n", "kvcap/bench/configs/m.json": "{}\n"}
    a = provenance.source_digest(_package(tmp_path / "a", files))
    # same files elsewhere, plus bytecode and other file kinds: same digest
    b_pkg = _package(tmp_path / "b", {**files, "kvcap/notes.txt": "ignored\n"})
    (b_pkg / "__pycache__").mkdir()
    (b_pkg / "__pycache__" / "stale.py").write_text("ignored\n")
    assert provenance.source_digest(b_pkg) == a
    assert len(a) == provenance.DIGEST_CHARS
    # one changed byte, a renamed file or an added source file changes it
    changed = _package(tmp_path / "c", {**files, "kvcap/__init__.py": "x = 2\n"})
    renamed = _package(tmp_path / "d", {"kvcap/init.py": "x = 1\n",
                                        "kvcap/bench/configs/m.json": "{}\n"})
    added = _package(tmp_path / "e", {**files, "kvcap/new.py": ""})
    digests = {provenance.source_digest(p) for p in (changed, renamed, added)}
    assert a not in digests and len(digests) == 3


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_revision_digest_matches_the_tree_it_committed(tmp_path):
    pkg = _package(tmp_path, {"kvcap/__init__.py": "x = 1\n", "kvcap/a.json": "[]\n"})
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    assert provenance.revision_digest("HEAD", repo=tmp_path) == provenance.source_digest(pkg)
    (pkg / "__init__.py").write_text("x = 3\n")  # the working tree moves on
    assert provenance.revision_digest("HEAD", repo=tmp_path) != provenance.source_digest(pkg)
    with pytest.raises(ValueError, match="no-such-rev"):
        provenance.revision_digest("no-such-rev", repo=tmp_path)


def test_stamp_prefers_kvcap_commit(monkeypatch):
    monkeypatch.setenv("KVCAP_COMMIT", "abc1234")
    s = provenance.stamp()
    assert s["commit"] == "abc1234"
    assert s["source_digest"] == provenance.source_digest()


def test_cli_prints_the_installed_digest(capsys):
    assert provenance.main([]) == 0
    assert provenance.source_digest() in capsys.readouterr().out


def test_kvcap_bench_provenance(capsys):
    from kvcap.cli import main

    assert main(["bench", "provenance"]) == 0
    assert provenance.source_digest() in capsys.readouterr().out
