"""Reading corpora and question files (JSON Lines) into `Document`s and `Question`s.

Field names are given as candidate lists ("text,context"): the first candidate present in a
record wins, so corpora with different schemas load in one call. With several corpora, ids are
namespaced by file stem ("squad_dev:1973_oil_crisis::0") so they cannot collide. Every problem is
an `InputError` naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragcache_core.documents import Document
from ragcache_core.errors import InputError

DEFAULT_TEXT_FIELDS = ("text",)
DEFAULT_ID_FIELDS = ("id", "doc_id")
DEFAULT_QUESTION_FIELDS = ("question", "input", "text")


@dataclass(frozen=True)
class Question:
    """One question of a request stream, with its gold answers when the file has them (an
    `answers` list or an `answer` string or list, as SQuAD and NQ-open write them)."""

    id: str
    text: str
    answers: tuple[str, ...] = ()


def parse_fields(spec: str | Sequence[str]) -> tuple[str, ...]:
    """'a,b' or ['a', 'b'] -> ('a', 'b'); raises `InputError` when empty."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    names = tuple(p.strip() for p in parts if p.strip())
    if not names:
        raise InputError(f"no field name given in {spec!r}")
    return names


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each non-blank line; raises `InputError` on bad JSON."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot open: {exc.strerror or exc}") from exc
    with handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{line_no}: invalid JSON: {exc.msg}") from exc
            if not isinstance(record, dict):
                raise InputError(f"{path}:{line_no}: expected a JSON object")
            yield line_no, record


def _pick(
    record: dict[str, Any], fields: Sequence[str], what: str, where: str, option: str | None = None
) -> tuple[str, object]:
    """The first of `fields` in `record`; `InputError` naming the fields looked for, the ones the
    record has, and the `option` that chooses them (a command's flag), when given."""
    for name in fields:
        if name in record:
            return name, record[name]
    has = ", ".join(map(str, record)) or "none"
    fix = f": set {option} to the record's {what} field" if option else ""
    raise InputError(
        f"{where}: no {what} field (looked for {', '.join(fields)}; the record has {has}){fix}"
    )


def load_corpus(
    paths: Sequence[Path | str],
    *,
    text_fields: str | Sequence[str] = DEFAULT_TEXT_FIELDS,
    id_fields: str | Sequence[str] = DEFAULT_ID_FIELDS,
    options: tuple[str, str] | None = None,
) -> tuple[Document, ...]:
    """All documents of the given JSONL corpora, in file then line order.

    Each document keeps the record's other fields as metadata (so "title" stays available to
    the prompt template) plus "source" (the file name). Raises `InputError` for an empty corpus,
    a missing or empty text field, a missing id field, or a duplicate id; `options` (a
    command's flags for the text and id fields, e.g. ("--text-field", "--id-field")) are named
    in the error for a missing field.
    """
    text_option, id_option = options or (None, None)
    texts, ids = parse_fields(text_fields), parse_fields(id_fields)
    files = [Path(p) for p in paths]
    if not files:
        raise InputError("no corpus file given")
    stems = [f.stem for f in files]
    if len(files) > 1 and len(set(stems)) < len(stems):
        raise InputError(f"corpora must have distinct file names to namespace ids: {stems}")
    namespaced = len(files) > 1
    docs: list[Document] = []
    seen: dict[str, str] = {}
    for path in files:
        for line_no, record in iter_jsonl(path):
            where = f"{path}:{line_no}"
            text_name, text = _pick(record, texts, "text", where, text_option)
            if not isinstance(text, str) or not text.strip():
                raise InputError(f"{where}: field {text_name!r} is empty or not a string")
            id_name, raw_id = _pick(record, ids, "id", where, id_option)
            if not isinstance(raw_id, str | int) or isinstance(raw_id, bool) or raw_id == "":
                raise InputError(f"{where}: field {id_name!r} must be a non-empty string or int")
            doc_id = f"{path.stem}:{raw_id}" if namespaced else str(raw_id)
            if doc_id in seen:
                raise InputError(f"{where}: duplicate id {doc_id!r} (first at {seen[doc_id]})")
            seen[doc_id] = where
            metadata = {k: v for k, v in record.items() if k not in (text_name, id_name)}
            metadata["source"] = path.name
            docs.append(Document(id=doc_id, text=text, metadata=metadata))
    if not docs:
        raise InputError(f"empty corpus: no documents in {', '.join(str(f) for f in files)}")
    return tuple(docs)


def load_questions(
    path: Path | str,
    *,
    question_fields: str | Sequence[str] = DEFAULT_QUESTION_FIELDS,
    id_fields: str | Sequence[str] = ("id", "qid"),
    limit: int | None = None,
) -> tuple[Question, ...]:
    """Questions of a JSONL file; the id is the id field when present, else the line's ordinal.

    Raises `InputError` for a file with no questions or a record without a question field.
    """
    fields, id_names = parse_fields(question_fields), parse_fields(id_fields)
    path = Path(path)
    out: list[Question] = []
    for line_no, record in iter_jsonl(path):
        if limit is not None and len(out) >= limit:
            break
        where = f"{path}:{line_no}"
        name, text = _pick(record, fields, "question", where)
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{where}: field {name!r} is empty or not a string")
        qid = next((str(record[n]) for n in id_names if n in record), str(len(out)))
        out.append(Question(id=qid, text=text, answers=_answers(record)))
    if not out:
        raise InputError(f"{path}: no questions")
    return tuple(out)


def _answers(record: dict[str, Any]) -> tuple[str, ...]:
    """A question record's gold answers: `answers` or `answer`, a string or a list of them."""
    value = record.get("answers", record.get("answer", ()))
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(str(a) for a in value if str(a).strip())
    return ()
