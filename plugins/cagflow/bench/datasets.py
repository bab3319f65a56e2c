"""Question sets for `cagflow bench answers --dataset`: public ones shipped in ``bench/datasets/`` (SQuAD 2.0,
CMRC 2018) or a user's own, in one format (README "Measure it on your documents"):

    NAME/manifest.yaml      a corpus manifest of the documents (the format of corpus/manifest.yaml)
    NAME/documents/...      the documents it names
    NAME/questions.jsonl    one question a line: id, question, answers (gold strings, [] when none),
                            doc_id (the document that answers it, null when none does), kind (answerable,
                            near_miss, unrelated), and optionally article, split, language

A dataset is split by *article*, never by question: every question belongs to the half of the document it
was written against (``article``; the answering document by default), so nothing tuned on the calibration
half has seen a report-half document. ``split`` in the file overrides that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..documents.text import language as language_of
from ..errors import CagflowError
from ..store.manifests import CorpusManifest

DATASETS_DIR = Path("bench/datasets")
KINDS = ("answerable", "near_miss", "unrelated")
SPLITS = ("calibration", "report")


class DatasetError(CagflowError, ValueError):
    """A dataset that cannot be found or read; the message says where."""

    code = "invalid_dataset"


@dataclass(frozen=True)
class DatasetQuestion:
    id: str
    question: str
    answers: tuple[str, ...]
    doc_id: str | None
    kind: str
    article: str | None
    split: str
    language: str

    @property
    def answerable(self) -> bool:
        return self.doc_id is not None


@dataclass(frozen=True)
class Dataset:
    name: str
    root: Path
    corpus: CorpusManifest
    questions: tuple[DatasetQuestion, ...]

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.yaml"

    @property
    def doc_ids(self) -> list[str]:
        return [entry.doc_id for entry in self.corpus.documents]


def resolve(name_or_path: str, datasets_dir: Path = DATASETS_DIR) -> Path:
    """A folder path as given, else the shipped dataset of that name."""
    given = Path(name_or_path)
    if given.is_dir():
        return given
    shipped = datasets_dir / name_or_path
    if shipped.is_dir():
        return shipped
    known = sorted(path.name for path in datasets_dir.iterdir() if path.is_dir()) if datasets_dir.is_dir() else []
    raise DatasetError(f"no dataset {name_or_path!r}: not a folder, and not one of {', '.join(known) or 'none'} "
                       f"in {datasets_dir}")


def _split_by_article(raw: list[dict]) -> dict[str, str]:
    """Every other article (sorted) to calibration; questions without one alternate in file order."""
    articles = sorted({item.get("article") or item.get("doc_id") for item in raw} - {None})
    return {article: SPLITS[number % 2] for number, article in enumerate(articles)}


def _question(raw: dict, where: str, doc_ids: set[str], halves: dict[str, str], position: int) -> DatasetQuestion:
    missing = [key for key in ("id", "question", "answers", "doc_id", "kind") if key not in raw]
    if missing:
        raise DatasetError(f"{where}: missing {', '.join(missing)}")
    if raw["kind"] not in KINDS:
        raise DatasetError(f"{where}: kind must be one of {', '.join(KINDS)}, got {raw['kind']!r}")
    if not isinstance(raw["answers"], list) or not all(isinstance(answer, str) for answer in raw["answers"]):
        raise DatasetError(f"{where}: answers must be a list of strings")
    if (raw["doc_id"] is None) != (raw["kind"] != "answerable"):
        raise DatasetError(f"{where}: an answerable question names its doc_id, any other kind has doc_id null")
    if raw["kind"] == "answerable" and not raw["answers"]:
        raise DatasetError(f"{where}: an answerable question needs at least one gold answer")
    article = raw.get("article", raw["doc_id"])
    for field, value in (("doc_id", raw["doc_id"]), ("article", article)):
        if value is not None and value not in doc_ids:
            raise DatasetError(f"{where}: {field} {value!r} is not a document of the manifest")
    split = raw.get("split") or halves.get(article) or SPLITS[position % 2]
    if split not in SPLITS:
        raise DatasetError(f"{where}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    return DatasetQuestion(str(raw["id"]), raw["question"], tuple(raw["answers"]), raw["doc_id"], raw["kind"],
                           article, split, raw.get("language") or language_of(raw["question"]))


def load_dataset(name_or_path: str, datasets_dir: Path = DATASETS_DIR) -> Dataset:
    root = resolve(name_or_path, datasets_dir)
    try:
        corpus = CorpusManifest.load(root / "manifest.yaml")
    except CagflowError as exc:
        raise DatasetError(str(exc)) from None
    path = root / "questions.jsonl"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"{path}: {exc.strerror or exc}") from None
    raw = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                raw.append((number, json.loads(line)))
            except ValueError as exc:
                raise DatasetError(f"{path}:{number}: not JSON ({exc})") from None
    halves = _split_by_article([item for _, item in raw])
    doc_ids = {entry.doc_id for entry in corpus.documents}
    questions = [_question(item, f"{path}:{number}", doc_ids, halves, position)
                 for position, (number, item) in enumerate(raw)]
    seen: set[str] = set()
    for question in questions:
        if question.id in seen:
            raise DatasetError(f"{path}: duplicate id {question.id!r}")
        seen.add(question.id)
    if not questions:
        raise DatasetError(f"{path}: no questions")
    return Dataset(root.name, root, corpus, tuple(questions))


def merged_manifest(base: Path, dataset: Dataset, into: Path) -> Path:
    """A corpus manifest holding ``base``'s documents and the dataset's, paths made absolute, written to
    ``into``: the stack serves both, so a dataset run keeps the corpus it was asked next to."""
    corpus = CorpusManifest.load(base)
    clashes = sorted(set(dataset.doc_ids) & {entry.doc_id for entry in corpus.documents})
    if clashes:
        raise DatasetError(f"{dataset.name}: doc_ids already in {base}: {', '.join(clashes)}")
    documents = [{**entry.model_dump(exclude_defaults=True), "path": str(manifest.file(entry))}
                 for manifest in (corpus, dataset.corpus) for entry in manifest.documents]
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text(yaml.safe_dump({"documents": documents}, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return into
