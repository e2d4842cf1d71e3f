"""Named corpora frozen to token ids, with a disjoint calibration/evaluation split.

Shards: `prose` (Debian license texts + the Python reference topics), `code` (stdlib Python
source), `chat` (conversations built from prose/code documents, rendered through the tokenizer's
chat template), `tool_json` (generated tool-call conversations, also through the template) and
`chinese` (installed gettext translations; skipped, with the reason recorded, when none exist).
Any other name that is a path to a text file becomes a one-file shard `file:<name>`.

Documents are split by group (see `kvcap.eval.sources`), never by position, so calibration and
evaluation never share a document; records are identified by `record_hash` (SHA-256 of the ids as
little-endian int32) and `write_manifest` freezes them with their provenance.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvcap.errors import ConfigError
from kvcap.eval import sources, synth
from kvcap.eval.sources import SPLITS, Document, Split
from kvcap.models.text_prompt import text_prefix
from kvcap.scales.fsutil import atomic_write_text

logger = logging.getLogger(__name__)

SHARD_NAMES: tuple[str, ...] = ("prose", "code", "chat", "tool_json", "chinese")
MANIFEST_SCHEMA = "kvcap-corpus-manifest/1"
MIN_RECORD_TOKENS = 16
_BATCH_DOCS = 16


@dataclass
class Shard:
    """One named corpus: token-id records and one provenance dict per record."""

    name: str
    records: list[list[int]] = field(default_factory=list)
    provenance: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.records)

    def hashes(self) -> list[str]:
        return [record_hash(r) for r in self.records]


def record_hash(token_ids: Iterable[int]) -> str:
    """SHA-256 of the token ids encoded as little-endian int32."""
    return hashlib.sha256(np.asarray(list(token_ids), dtype="<i4").tobytes()).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 over the sorted vocabulary (token -> id) and the chat template."""
    vocab = sorted(tokenizer.get_vocab().items())
    blob = json.dumps([vocab, getattr(tokenizer, "chat_template", None)], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def unavailable_reason(name: str) -> str | None:
    """Why a built-in shard cannot be built on this machine, or None when it can."""
    if name == "chinese":
        return sources.chinese_unavailable_reason()
    if name == "prose" and not sources.prose_documents():
        return "no installed prose source found"
    return None


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _chunk_docs(tokenizer: Any, docs: list[Document], record_tokens: int
                ) -> Iterator[tuple[list[int], dict[str, Any]]]:
    """Records of at most `record_tokens` ids: the tokenizer's text prefix, then a piece cut
    from each document in order (`token_offset`: where the piece starts in the document).
    Served text prompts begin with that prefix (Llama's and Mistral's BOS), so calibration sees
    the K/V of the sequence start every request has (a sink token's can be its layer's
    largest), and evaluation measures what serving runs."""
    prefix = text_prefix(tokenizer)
    room = record_tokens - len(prefix)
    for start in range(0, len(docs), _BATCH_DOCS):
        batch = docs[start:start + _BATCH_DOCS]
        for doc, ids in zip(batch, _encode(tokenizer, [d.text for d in batch]), strict=True):
            for off in range(0, len(ids), room):
                piece = ids[off:off + room]
                if len(piece) >= MIN_RECORD_TOKENS:
                    yield prefix + piece, {**doc.provenance, "doc_id": doc.doc_id,
                                           "token_offset": off}


def _render(tokenizer: Any, messages: list[dict[str, str]], record_tokens: int) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return _encode(tokenizer, [text])[0][:record_tokens]


def _chat_records(tokenizer: Any, split: Split, seed: int, record_tokens: int
                  ) -> Iterator[tuple[list[int], dict[str, Any]]]:
    docs = sources.select_split("prose", sources.prose_documents(), split)
    docs += sources.select_split("code", sources.code_documents(), split)
    docs.sort(key=lambda d: hashlib.sha256(f"chat/{d.doc_id}".encode()).hexdigest())
    for messages, prov in synth.chat_conversations(docs, seed):
        yield _render(tokenizer, messages, record_tokens), prov


def _tool_records(tokenizer: Any, split: Split, seed: int, record_tokens: int
                  ) -> Iterator[tuple[list[int], dict[str, Any]]]:
    index = 0
    while True:
        messages, prov = synth.tool_conversation(seed, split, index)
        yield _render(tokenizer, messages, record_tokens), prov
        index += 1


def _file_records(tokenizer: Any, path: Path, record_tokens: int
                  ) -> Iterator[tuple[list[int], dict[str, Any]]]:
    raw = path.read_bytes()
    doc = Document(f"file:{path}", str(path), raw.decode("utf-8"),
                   {"source": "file", "path": str(path), "sha256": hashlib.sha256(raw).hexdigest()})
    yield from _chunk_docs(tokenizer, [doc], record_tokens)


def _records(tokenizer: Any, name: str, split: Split, seed: int, record_tokens: int
             ) -> Iterator[tuple[list[int], dict[str, Any]]]:
    if name in ("prose", "code"):
        docs = sources.prose_documents() if name == "prose" else sources.code_documents()
        return _chunk_docs(tokenizer, sources.select_split(name, docs, split), record_tokens)
    if name == "chinese":
        docs = sources.select_split("chinese", sources.chinese_documents(), split)
        return _chunk_docs(tokenizer, docs, record_tokens)
    if name == "chat":
        return _chat_records(tokenizer, split, seed, record_tokens)
    if name == "tool_json":
        return _tool_records(tokenizer, split, seed, record_tokens)
    return _file_records(tokenizer, Path(name[len("file:"):]), record_tokens)


def _check_utf8(path: Path) -> None:
    # A corpus file is decoded strictly: replacing bad bytes with U+FFFD would calibrate on
    # text the user never wrote, and the manifest's sha256 would not say so.
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"corpus file {path} is not UTF-8 text (byte {e.start}: {e.reason}): "
                          "convert it, e.g. iconv -t UTF-8, or pass another file") from None
    except OSError as e:
        raise ConfigError(f"corpus file {path} cannot be read: {e.strerror}") from None


def resolve_names(names: list[str] | None) -> list[str]:
    """Validate shard names before any work: built-ins, or paths to existing text files (returned
    as `file:<absolute path>`). None means every built-in shard available on this machine."""
    if names is None:
        out = []
        for n in SHARD_NAMES:
            reason = unavailable_reason(n)
            if reason:
                logger.warning("skipping corpus %r: %s", n, reason)
            else:
                out.append(n)
        return out
    out = []
    for n in names:
        if n in SHARD_NAMES:
            reason = unavailable_reason(n)
            if reason:
                raise ConfigError(f"corpus {n!r} is unavailable: {reason}")
            out.append(n)
        elif Path(n).is_file():
            _check_utf8(Path(n))
            out.append(f"file:{Path(n).resolve()}")
        else:
            raise ConfigError(f"unknown corpus {n!r}: use one of {', '.join(SHARD_NAMES)} "
                              "or the path of a text file")
    if len(set(out)) != len(out):
        raise ConfigError(f"corpus names repeat: {names}")
    return out


def build_shards(tokenizer: Any, names: list[str] | None = None, max_tokens: int = 200_000,
                 split: Split = "calibration", record_tokens: int = 512, seed: int = 0,
                 exclude_hashes: set[str] | None = None, progress: bool = True) -> list[Shard]:
    """Freeze the named corpora to token ids, deterministically.

    `max_tokens` is the total over all shards: each shard gets `remaining // shards_left`, so a
    shard that runs out of text leaves its share to the shards after it. Records hold at most
    `record_tokens` ids (the last one of a shard is cut to fit the budget). Records whose hash is
    in `exclude_hashes` (e.g. a calibration manifest) are skipped.
    """
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
    if max_tokens <= 0 or record_tokens < MIN_RECORD_TOKENS:
        raise ConfigError(f"need max_tokens > 0 and record_tokens >= {MIN_RECORD_TOKENS}")
    resolved = resolve_names(names)
    exclude = exclude_hashes or set()
    shards: list[Shard] = []
    remaining = max_tokens
    bar = tqdm(total=max_tokens, desc=f"corpora ({split})", unit="tok", disable=not progress)
    for i, name in enumerate(resolved):
        budget = remaining // (len(resolved) - i)
        shard = Shard(name)
        for ids, prov in _records(tokenizer, name, split, seed, record_tokens):
            left = budget - shard.num_tokens
            if left < MIN_RECORD_TOKENS:
                break
            ids = ids[:left]
            if len(ids) < MIN_RECORD_TOKENS or record_hash(ids) in exclude:
                continue
            shard.records.append(ids)
            shard.provenance.append({**prov, "tokens": len(ids)})
            bar.update(len(ids))
        logger.info("corpus %s/%s: %d records, %d tokens", name, split, len(shard.records),
                    shard.num_tokens)
        remaining -= shard.num_tokens
        shards.append(shard)
    bar.close()
    return shards


def manifest_dict(shards: list[Shard], tokenizer: Any, split: Split, *, seed: int = 0,
                  record_tokens: int | None = None) -> dict[str, Any]:
    built = {s.name for s in shards}
    skipped = {n: unavailable_reason(n) or "not requested" for n in SHARD_NAMES if n not in built}
    return {
        "schema": MANIFEST_SCHEMA,
        "split": split,
        "seed": seed,
        "record_tokens": record_tokens,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "python": sources.python_info(),
        "total_tokens": sum(s.num_tokens for s in shards),
        "skipped": skipped,
        "shards": [{"name": s.name, "num_records": len(s.records), "num_tokens": s.num_tokens,
                    "record_tokens": [len(r) for r in s.records], "record_hashes": s.hashes(),
                    "provenance": s.provenance} for s in shards],
    }


def write_manifest(path: str | Path, shards: list[Shard], tokenizer: Any, split: Split, *,
                   seed: int = 0, record_tokens: int | None = None) -> Path:
    """Write the corpus manifest (per shard: name, record hashes, provenance, token counts)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = manifest_dict(shards, tokenizer, split, seed=seed, record_tokens=record_tokens)
    text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    # (a file corpus path with undecodable bytes holds lone surrogates: escaped)
    atomic_write_text(path, text, errors="backslashreplace")
    return path


def manifest_hashes(path: str | Path) -> set[str]:
    """Every record hash listed in a corpus manifest."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return {h for s in data["shards"] for h in s["record_hashes"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read corpus manifest {path}: {exc}") from exc
