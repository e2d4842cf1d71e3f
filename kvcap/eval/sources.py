"""Installed text sources for calibration and evaluation corpora, with provenance.

Every document comes from something already on the machine (the Python standard library and its
documentation topics, Debian's /usr/share/common-licenses, gettext catalogs under
/usr/share/locale); nothing is downloaded. Each document carries a `group`: the unit that is
assigned as a whole to the calibration or the evaluation split (a license family such as all GPL
versions, a top-level stdlib package, one gettext domain), so near-duplicate texts never straddle
the two splits.
"""

from __future__ import annotations

import functools
import gettext
import glob
import hashlib
import logging
import os
import platform
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

Split = Literal["calibration", "evaluation"]
SPLITS: tuple[str, ...] = ("calibration", "evaluation")
EVAL_EVERY = 5  # about one group in EVAL_EVERY (by hash) is held out for evaluation
# a run of this many identical non-blank lines is copied text, not a shared idiom
SHARED_LINES = 8

LICENSES_DIR = Path("/usr/share/common-licenses")
LOCALE_DIR = Path("/usr/share/locale")
CHINESE_LOCALES = ("zh_CN", "zh_TW")
_CJK = re.compile(r"[\u4e00-\u9fff]")
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_MAX_CODE_BYTES = 200_000


@dataclass(frozen=True)
class Document:
    """One source text. `doc_id` is stable across runs; `group` decides the split."""

    doc_id: str
    group: str
    text: str
    provenance: dict[str, Any] = field(default_factory=dict)


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def split_of(source: str, group: str) -> Split:
    """Assign a whole `group` to a split from SHA-256 of `source/group` alone (independent of
    which other groups are installed): one group in EVAL_EVERY goes to evaluation."""
    held_out = int(_sha(f"{source}/{group}")[:8], 16) % EVAL_EVERY == 0
    return "evaluation" if held_out else "calibration"


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def _copies_calibration(doc: Document, windows: set[int], blob: str) -> bool:
    """Whether `doc` holds a run of SHARED_LINES lines (or, shorter, all its lines) that a
    calibration document also holds."""
    lines = _lines(doc.text)
    if len(lines) < SHARED_LINES:
        return bool(lines) and "\n" + "\n".join(lines) + "\n" in blob  # whole lines
    return any(hash("\n".join(lines[i:i + SHARED_LINES])) in windows
               for i in range(len(lines) - SHARED_LINES + 1))


def select_split(source: str, docs: Iterable[Document], split: Split) -> list[Document]:
    """The documents of `split`, in a stable mixed order (SHA-256 of doc_id).

    Groups do not catch every copy: pydoc topics repeat each other's sections (`for` is a part
    of `compound`), gettext ships one catalog under two domains (iso_3166_2, iso_3166-2), and
    stdlib modules vendor others (lib2to3's tokenize). So an evaluation document that shares a
    run of SHARED_LINES lines with a calibration document is left out of evaluation; the
    calibration split (and so the scales) stays as the groups make it."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    tagged = [(d, split_of(source, d.group)) for d in docs]
    kept = [d for d, s in tagged if s == split]
    if split == "evaluation":
        cal = [_lines(d.text) for d, s in tagged if s == "calibration"]
        windows = {hash("\n".join(ls[i:i + SHARED_LINES]))
                   for ls in cal for i in range(len(ls) - SHARED_LINES + 1)}
        blob = "".join("\n" + "\n".join(ls) + "\n" for ls in cal)
        kept = [d for d in kept if not _copies_calibration(d, windows, blob)]
    return sorted(kept, key=lambda d: _sha(d.doc_id))


@functools.lru_cache(maxsize=1)
def _dpkg_owners() -> dict[str, str]:
    """Map installed file path -> Debian package, from /var/lib/dpkg/info/*.list (if present)."""
    owners: dict[str, str] = {}
    for lst in sorted(glob.glob("/var/lib/dpkg/info/*.list")):
        pkg = Path(lst).stem.split(":")[0]
        try:
            with open(lst, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.startswith(("/usr/share/common-licenses", "/usr/share/locale/zh")):
                        owners[line.rstrip("\n")] = pkg
        except OSError:
            continue
    return owners


def debian_package(path: Path) -> str | None:
    """The Debian package that installed `path`, or None when unknown (non-Debian system)."""
    return _dpkg_owners().get(str(path))


def python_info() -> dict[str, str]:
    return {"python": platform.python_version(), "stdlib": sysconfig.get_paths()["stdlib"]}


def license_documents() -> list[Document]:
    """Each file of /usr/share/common-licenses (symlinks resolved and de-duplicated);
    group = license family with the version stripped (GPL-2 and GPL-3 share a group)."""
    if not LICENSES_DIR.is_dir():
        return []
    docs: list[Document] = []
    seen: set[Path] = set()
    for path in sorted(LICENSES_DIR.iterdir()):
        real = path.resolve()
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        text = real.read_text(encoding="utf-8", errors="replace")
        family = re.sub(r"-[\d.]+$", "", real.name)
        prov = {"source": "common-licenses", "path": str(real), "package": debian_package(real)}
        docs.append(Document(f"license:{real.name}", f"license:{family}", text, prov))
    return docs


def pydoc_topic_documents() -> list[Document]:
    """The Python language reference topics shipped in the stdlib (`pydoc_data.topics`)."""
    from pydoc_data.topics import topics

    info = python_info()
    docs = []
    for key in sorted(topics):
        prov = {"source": "python-stdlib", "module": "pydoc_data.topics", "key": key, **info}
        docs.append(Document(f"pydoc:{key}", f"pydoc:{key}", topics[key], prov))
    return docs


@functools.lru_cache(maxsize=1)
def prose_documents() -> tuple[Document, ...]:
    return tuple(license_documents() + pydoc_topic_documents())


def _stdlib_files() -> Iterator[tuple[Path, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                yield root, path


@functools.lru_cache(maxsize=1)
def code_documents() -> tuple[Document, ...]:
    """Python source of the standard library (tests and site-packages excluded);
    group = top-level module or package."""
    info = python_info()
    docs = []
    for root, path in _stdlib_files():
        if path.stat().st_size > _MAX_CODE_BYTES:
            continue
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        group = rel.split("/")[0].removesuffix(".py")
        prov = {"source": "python-stdlib", "path": str(path), **info}
        docs.append(Document(f"stdlib:{rel}", group, text, prov))
    return tuple(docs)


@functools.lru_cache(maxsize=1)
def chinese_documents() -> tuple[Document, ...]:
    """Chinese message translations from installed gettext catalogs (`.mo`), one document per
    catalog: every translated string containing CJK characters, one per line, in msgid order."""
    docs = []
    for loc in CHINESE_LOCALES:
        for path in sorted((LOCALE_DIR / loc / "LC_MESSAGES").glob("*.mo")):
            try:
                with open(path, "rb") as fh:
                    catalog = gettext.GNUTranslations(fh)._catalog  # type: ignore[attr-defined]
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                logger.debug("skipping unreadable catalog %s: %s", path, exc)
                continue
            lines = [
                str(v).strip()
                for k, v in sorted(catalog.items(), key=lambda kv: str(kv[0]))
                if k and _CJK.search(str(v))
            ]
            if not lines:
                continue
            prov = {"source": "gettext", "path": str(path), "package": debian_package(path),
                    "locale": loc, "domain": path.stem}
            docs.append(Document(f"gettext:{loc}/{path.stem}", path.stem, "\n".join(lines), prov))
    return tuple(docs)


def chinese_unavailable_reason() -> str | None:
    """None when an installed Chinese source exists, else why the shard is skipped."""
    if chinese_documents():
        return None
    return (f"no installed Chinese text found: no gettext catalogs with CJK translations under "
            f"{LOCALE_DIR}/{{{','.join(CHINESE_LOCALES)}}}/LC_MESSAGES")
