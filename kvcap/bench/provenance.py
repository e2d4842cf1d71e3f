"""What code a benchmark result came from: the commit, and a digest of the `kvcap` sources.

A benchmark run on a copied working tree (the GPU machine gets a copy of the files, and its
`.git` can lag behind them) may report a commit other than the code it ran. Every benchmark
JSON therefore also records `source_digest`: a SHA-256 over the package's `.py` and `.json`
files (relative path and bytes, in path order), which depends only on the files themselves.
To check which revision a result belongs to:

    python -m kvcap.bench.provenance                 # the digest of the importable kvcap
    python -m kvcap.bench.provenance REV [REV ...]   # ... and of kvcap at each git revision

A result whose `source_digest` equals a revision's ran that revision's package code.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # .../kvcap
SOURCE_SUFFIXES = (".py", ".json")
DIGEST_CHARS = 16


def _digest(files: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for rel, data in sorted(files):
        h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:DIGEST_CHARS]


def _wanted(rel: str) -> bool:
    return rel.endswith(SOURCE_SUFFIXES) and "__pycache__" not in rel.split("/")


def source_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """Digest of the package's sources under `package_dir` (paths relative to its parent, so
    `kvcap/...` whichever directory holds it)."""
    files = []
    for path in package_dir.rglob("*"):
        rel = path.relative_to(package_dir.parent).as_posix()
        if path.is_file() and _wanted(rel):
            files.append((rel, path.read_bytes()))
    return _digest(files)


def revision_digest(rev: str, repo: Path = PACKAGE_DIR.parent, package: str = "kvcap") -> str:
    """Digest of `package` at git revision `rev` of `repo` (read with `git archive`)."""
    try:
        tar = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", rev, package],
                             capture_output=True, check=True, timeout=60).stdout
    except subprocess.CalledProcessError as e:
        raise ValueError(f"git archive {rev} {package} in {repo} failed: "
                         f"{e.stderr.decode(errors='replace').strip()}") from None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"cannot run git in {repo}: {e}") from None
    files = []
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for member in archive.getmembers():
            if member.isfile() and _wanted(member.name):
                files.append((member.name, archive.extractfile(member).read()))
    return _digest(files)


def commit(repo: Path = PACKAGE_DIR.parent) -> str:
    """KVCAP_COMMIT when set, else git's short HEAD of `repo`, else "unknown". On a copied tree
    this can be stale: source_digest is the check."""
    if os.environ.get("KVCAP_COMMIT"):
        return os.environ["KVCAP_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out or "unknown"


def result_path(out: Path, stem: str) -> Path:
    """Where a run writes its JSON: `out` itself when it names a .json file, else
    out/STEM.json, or out/STEM-N.json with the first N >= 2 not taken."""
    if out.suffix == ".json":
        out.parent.mkdir(parents=True, exist_ok=True)
        return out
    out.mkdir(parents=True, exist_ok=True)
    path, n = out / f"{stem}.json", 2
    while path.exists():
        path, n = out / f"{stem}-{n}.json", n + 1
    return path


def stamp() -> dict[str, str]:
    """The provenance fields every benchmark JSON records."""
    return {"commit": commit(), "source_digest": source_digest()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs="*", help="git revisions to digest kvcap at")
    args = ap.parse_args(argv)
    print(f"{source_digest()}  {PACKAGE_DIR} (the importable kvcap)")
    for rev in args.revs:
        try:
            print(f"{revision_digest(rev)}  {rev}")
        except ValueError as e:
            print(f"error: {e}")
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
