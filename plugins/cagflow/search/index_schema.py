"""What the chunk index stores: the chunk type, the text that gets embedded, the index's settings and
mappings, and a chunk's form as an indexed document. One place for the schema, because its id decides
when an existing index must be rebuilt (see ``cagflow.search.retrieval``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

TIERS = ("fixed", "variable")
# The fields a search returns; a scan adds the vector and the source digest.
SOURCE_FIELDS = ["chunk_id", "doc_id", "text", "tier", "version", "title", "section", "published"]

# One analyzer for English and Chinese text, so a collection in both languages needs no per-document
# setting: the standard tokenizer splits Han text into single characters, which ``cjk_bigram`` joins into
# overlapping pairs (a word of two characters is found whole, and no dictionary is needed), while Latin
# words are lower-cased and stemmed ("backups" finds "backup"). ``cjk_width`` folds full-width Latin and
# digits ("９４４３") into their ASCII forms.
TEXT_ANALYZER = {
    "tokenizer": "standard",
    "filter": ["cjk_width", "lowercase", "cjk_bigram", "english_possessive_stemmer", "porter_stem"],
}


@dataclass(frozen=True)
class Chunk:
    chunk_id: str
    doc_id: str
    text: str
    tier: str = "variable"
    version: str = ""
    title: str = ""
    section: str = ""
    published: str = ""  # ISO date of the document, or empty
    embedding: Sequence[float] | None = field(default=None, repr=False, compare=False)
    source_sha256: str = ""  # digest of what the document's chunks were made from (an unchanged one is skipped)

    def __post_init__(self) -> None:
        if not self.chunk_id or not self.doc_id:
            raise ValueError("a chunk needs a chunk_id and a doc_id")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")


def embedding_text(title: str, section: str, text: str) -> str:
    """What gets embedded: the chunk under its document title and section, which carry its topic."""
    heading = " — ".join(part for part in (title, section) if part)
    return f"{heading}\n{text}" if heading else text


def chunk_source(chunk: Chunk, vector: Sequence[float]) -> dict[str, Any]:
    """The indexed document of ``chunk`` with its embedding ``vector``."""
    return {
        "chunk_id": chunk.chunk_id, "doc_id": chunk.doc_id, "text": chunk.text, "tier": chunk.tier,
        "version": chunk.version, "title": chunk.title, "section": chunk.section,
        "published": chunk.published, "source_sha256": chunk.source_sha256,
        "embedding": [float(value) for value in vector],
    }


def chunk_from_source(source: Mapping[str, Any]) -> Chunk:
    """The chunk an indexed document holds, with its embedding (fields an older index lacks stay empty)."""
    return Chunk(source["chunk_id"], source["doc_id"], source["text"], source["tier"],
                 source.get("version", ""), source.get("title", ""), source.get("section", ""),
                 source.get("published", ""), embedding=source["embedding"],
                 source_sha256=source.get("source_sha256", ""))


def index_body(dimension: int, embedder_id: str, shards: int = 1, replicas: int = 0) -> dict[str, Any]:
    text = {"type": "text", "analyzer": "cagflow_text"}
    body = {
        "settings": {
            "index": {"knn": True, "number_of_shards": shards, "number_of_replicas": replicas},
            "analysis": {
                "analyzer": {"cagflow_text": TEXT_ANALYZER},
                "filter": {"english_possessive_stemmer": {"type": "stemmer", "language": "possessive_english"}},
            },
        },
        "mappings": {
            "dynamic": "strict",
            "properties": {
                "chunk_id": {"type": "keyword"},
                "doc_id": {"type": "keyword"},
                "tier": {"type": "keyword"},
                "version": {"type": "keyword"},
                "published": {"type": "keyword"},  # ISO dates compare as strings
                "source_sha256": {"type": "keyword"},
                "title": text,
                "section": text,
                "text": text,
                "embedding": {
                    "type": "knn_vector",
                    "dimension": dimension,
                    "method": {"name": "hnsw", "engine": "lucene", "space_type": "cosinesimil"},
                },
            },
        },
    }
    body["mappings"]["_meta"] = {"embedder": embedder_id}
    body["mappings"]["_meta"]["schema"] = schema_id(body)
    return body


def schema_id(body: Mapping[str, Any]) -> str:
    """What makes two indexes interchangeable: analysis settings, field mappings and the embedding model.
    Shard and replica counts are left out (they change no search result)."""
    mappings = {key: value for key, value in body["mappings"].items() if key != "_meta"}
    embedder = body["mappings"].get("_meta", {}).get("embedder", "")
    described = {"analysis": body["settings"].get("analysis"), "mappings": mappings, "embedder": embedder}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
