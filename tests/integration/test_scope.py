"""In-scope detection over chunk vectors read back from a real OpenSearch node, and its calibration."""

import uuid
from dataclasses import replace

import numpy as np
import pytest
from cagflow.answering.qa import QAItem
from cagflow.search.embeddings import get_embedder
from cagflow.search.index_schema import Chunk, embedding_text, index_body
from cagflow.search.retrieval import ChunkIndex
from cagflow.search.scope import (NO_MATCH_SCORE, ScopeDetector, ScopeMatch, calibrate, calibrate_answerability,
                                  evaluate, evaluate_answerability)

CHUNKS = [
    Chunk("leave-1", "hr-handbook", "Full-time employees receive 25 days of paid annual leave per calendar year.",
          tier="fixed", version="3", title="HR handbook", section="Leave"),
    Chunk("leave-2", "hr-handbook", "Sick leave requires a medical certificate from the third day of absence.",
          tier="fixed", version="3", title="HR handbook", section="Sickness"),
    Chunk("vpn-1", "it-guide", "To connect to the corporate VPN, install the WireGuard client and import the "
          "configuration file from the IT portal.", tier="fixed", version="7", title="IT guide", section="VPN",
          published="2024-06-01"),
    Chunk("vpn-2", "it-guide", "Passwords must be rotated every 90 days and contain at least 14 characters.",
          tier="fixed", version="7", title="IT guide", section="Accounts", published="2024-06-01"),
    Chunk("update-1", "it-guide-amendment", "From March on, passwords must contain at least 16 characters.",
          tier="variable", version="1", title="IT guide amendment", section="Passwords", published="2025-03-01"),
    Chunk("menu-1", "canteen-menu", "This week the canteen serves vegetable lasagna on Monday and grilled salmon "
          "on Friday.", tier="variable", version="w49", title="Canteen menu", section="This week"),
    Chunk("status-1", "service-status", "The payroll system is down for maintenance on Saturday from 08:00 to "
          "12:00 UTC.", tier="variable", version="12-02", title="Service status", section="Maintenance"),
]
THRESHOLD = 0.84  # e5 scores related text 0.87-0.93 here, unrelated 0.69-0.82


@pytest.fixture(scope="module")
def embedder():
    return get_embedder()


@pytest.fixture(scope="module")
def index(opensearch_url, embedder):
    with ChunkIndex(opensearch_url, f"it-scope-{uuid.uuid4().hex[:8]}", timeout_s=30, embedder=embedder) as index:
        index.ensure_index()
        index.upsert(CHUNKS)
        yield index


@pytest.fixture
def detector(index):
    detector = ScopeDetector(index, THRESHOLD)
    detector.refresh()
    return detector


@pytest.mark.integration
def test_scan_pages_through_every_chunk_with_its_vector(index, embedder):
    scanned = list(index.scan(page_size=4))  # two pages, the second one short
    assert sorted(chunk.chunk_id for chunk in scanned) == sorted(chunk.chunk_id for chunk in CHUNKS)
    vpn = next(chunk for chunk in scanned if chunk.chunk_id == "vpn-1")
    chunk = CHUNKS[2]
    assert np.allclose(vpn.embedding, embedder.encode([embedding_text(chunk.title, chunk.section, chunk.text)])[0],
                       atol=1e-5)
    fixed = {chunk.chunk_id for chunk in index.scan(tier="fixed", page_size=2)}
    assert fixed == {"leave-1", "leave-2", "vpn-1", "vpn-2"}


@pytest.mark.integration
def test_refresh_holds_the_fixed_chunks(detector):
    assert detector.size == 4 and detector.doc_ids == {"hr-handbook", "it-guide"}


@pytest.mark.integration
@pytest.mark.parametrize("question, doc_id", [
    ("How many days of annual leave do full-time employees get?", "hr-handbook"),
    ("How do I set up the VPN on my laptop?", "it-guide"),
])
def test_questions_about_fixed_documents_are_in_scope(detector, embedder, question, doc_id):
    match = detector.match(embedder.encode_query(question))
    assert match.in_scope and match.doc_id == doc_id and match.score > match.other_score


@pytest.mark.integration
@pytest.mark.parametrize("question", ["What food does the canteen serve this week?",
                                      "When is the payroll system offline for maintenance?"])
def test_a_closer_variable_chunk_keeps_a_question_out_of_scope(detector, embedder, question):
    match = detector.match(embedder.encode_query(question))
    assert not match.in_scope and match.other_score > match.score


@pytest.mark.integration
def test_an_unrelated_question_is_out_of_scope(detector, embedder):
    match = detector.match(embedder.encode_query("Who won the football world cup in 2018?"))
    assert not match.in_scope and match.score < THRESHOLD


@pytest.mark.integration
def test_the_best_score_covers_chunks_of_every_tier(detector, embedder):
    menu = detector.match(embedder.encode_query("What does the canteen serve on Friday?"))
    assert menu.best_score == menu.other_score > menu.score  # the canteen menu is variable
    football = detector.match(embedder.encode_query("Who won the football world cup in 2018?"))
    assert football.best_score < menu.best_score and detector.total_chunks == len(CHUNKS)


@pytest.mark.integration
def test_a_cached_answer_cites_the_closest_chunk_of_its_document(detector, embedder):
    question = "How often must passwords be rotated?"
    citation = detector.cite("it-guide", embedder.encode_query(f"{question}\nEvery 90 days."))
    assert (citation.doc_id, citation.chunk_id, citation.title, citation.section) == \
        ("it-guide", "vpn-2", "IT guide", "Accounts")
    assert citation.to_dict()["score"] == round(citation.score, 4) and 0 < citation.score <= 1
    # only that document's chunks are candidates, however close another document's chunk is
    leave = detector.cite("it-guide", embedder.encode_query("How many days of paid annual leave? 25 days."))
    assert leave.doc_id == "it-guide"
    assert detector.cite("no-such-doc", embedder.encode_query(question)) is None


@pytest.mark.integration
def test_only_documents_of_the_release_are_cacheable(index, embedder):
    detector = ScopeDetector(index, THRESHOLD)
    assert detector.refresh(doc_ids=["it-guide"]) == 2
    leave = detector.match(embedder.encode_query("How many days of annual leave do full-time employees get?"))
    assert not leave.in_scope and leave.doc_id == "it-guide"  # the handbook's own chunks now outscore it
    assert detector.match(embedder.encode_query("How do I set up the VPN on my laptop?")).in_scope


@pytest.mark.integration
def test_the_question_vector_can_be_reused_for_search(index, embedder):
    question = "How do I set up the VPN on my laptop?"
    vector = embedder.encode_query(question)
    assert index.search(question, vector=vector) == index.search(question)


@pytest.mark.integration
def test_a_closer_chunk_of_a_newer_document_is_reported_as_a_possible_update(detector, embedder):
    vector = embedder.encode_query("How many characters must a password have?")
    match = detector.match(vector)
    assert match.doc_id == "it-guide" and match.published == "2024-06-01"
    assert match.other_published == "2025-03-01" and match.other_score > match.score and match.newer_other
    assert not match.in_scope  # plain in-scope routing is unchanged: the router decides on the update
    assert detector.published("it-guide") == "2024-06-01" and detector.published("hr-handbook") == ""
    assert detector.similarity("update-1", vector) == pytest.approx(match.other_score, abs=1e-5)
    assert detector.similarity("vpn-2", vector) is None  # cacheable chunks are not looked up this way
    leave = detector.match(embedder.encode_query("How many days of paid annual leave do I get?"))
    assert leave.in_scope and not leave.newer_other


@pytest.mark.integration
def test_an_index_of_another_schema_is_rebuilt_with_its_chunks_re_embedded(opensearch_url, embedder):
    """An index made with another embedding model and analyzer (as before this version) is replaced on the
    next ingest by one of the current schema, holding the same chunks with vectors of the current model."""
    alias = f"it-scope-old-{uuid.uuid4().hex[:8]}"
    with ChunkIndex(opensearch_url, alias, timeout_s=30, embedder=embedder) as index:
        body = index_body(embedder.dimension, "all-MiniLM-L6-v2")
        del body["settings"]["analysis"]
        for field in ("title", "section", "text"):
            body["mappings"]["properties"][field] = {"type": "text"}
        del body["mappings"]["_meta"]
        body["aliases"] = {alias: {}}
        index._client.indices.create(index=f"{alias}-old", body=body)
        stale = [replace(chunk, embedding=[1.0] + [0.0] * (embedder.dimension - 1)) for chunk in CHUNKS[:3]]
        index._bulk_index(f"{alias}-old", stale, refresh=True)

        rebuilt = index.ensure_index()
        assert rebuilt != f"{alias}-old" and index._alias_targets() == [rebuilt]
        assert not index._client.indices.exists(index=f"{alias}-old")
        chunks = {chunk.chunk_id: chunk for chunk in index.scan()}
        assert sorted(chunks) == sorted(chunk.chunk_id for chunk in CHUNKS[:3])
        expected = embedder.encode([embedding_text(c.title, c.section, c.text) for c in CHUNKS[:3]])
        for chunk, vector in zip(CHUNKS[:3], expected):
            assert np.allclose(chunks[chunk.chunk_id].embedding, vector, atol=1e-5)
        assert index.search("annual leave days", top_k=1)[0].chunk_id == "leave-1"
        assert index.ensure_index() == rebuilt  # the current schema is kept as it is


@pytest.mark.integration
def test_an_empty_index_matches_nothing(opensearch_url, embedder):
    with ChunkIndex(opensearch_url, f"it-scope-empty-{uuid.uuid4().hex[:8]}", timeout_s=30, embedder=embedder) as empty:
        empty.ensure_index()
        detector = ScopeDetector(empty, THRESHOLD)
        assert detector.refresh() == 0
        assert detector.match(embedder.encode_query("anything")) == ScopeMatch(None, NO_MATCH_SCORE, False)


# --- calibration (pure)


def labelled(in_scope: bool, doc_id: str | None) -> QAItem:
    return QAItem(id=uuid.uuid4().hex, question="q", reference_answer="a", keywords=(), in_scope=in_scope,
                  doc_id=doc_id)


def test_calibration_takes_the_highest_recall_that_keeps_precision():
    records = [labelled(True, "a"), labelled(True, "a"), labelled(True, "b"), labelled(False, None),
               labelled(True, "b"), labelled(False, "news")]
    matches = [ScopeMatch("a", 0.9, False), ScopeMatch("a", 0.8, False), ScopeMatch("a", 0.7, False),
               ScopeMatch("b", 0.6, False), ScopeMatch("b", 0.5, False),
               ScopeMatch("a", 0.95, False, other_score=0.97)]
    calibration = calibrate(records, matches)
    assert calibration.threshold == 0.65 and calibration.rule.startswith("highest recall")
    assert (calibration.chosen.precision, calibration.chosen.recall, calibration.chosen.routed_to_cache) == (1.0, 0.75, 3)
    assert calibration.chosen.doc_accuracy == pytest.approx(2 / 3)  # the third is routed to the wrong document
    everything = evaluate(records, matches, 0.0)
    assert everything.routed_to_cache == 5 and everything.precision == 0.8  # 0.95 lost to a closer variable chunk


def test_calibration_falls_back_to_the_best_f1():
    records = [labelled(False, None), labelled(True, "a"), labelled(False, None), labelled(True, "a")]
    matches = [ScopeMatch("a", 0.9, False), ScopeMatch("a", 0.8, False), ScopeMatch("a", 0.7, False),
               ScopeMatch("a", 0.6, False)]
    calibration = calibrate(records, matches)
    assert calibration.rule.startswith("best F1") and calibration.threshold == 0.599
    assert calibration.chosen.recall == 1.0 and calibration.chosen.precision == 0.5


def test_answerability_takes_the_highest_threshold_that_keeps_the_answerable_questions():
    records = [labelled(True, "a"), labelled(False, "news"), labelled(True, "b"), labelled(False, None),
               labelled(False, None), labelled(True, "a")]
    matches = [ScopeMatch("a", 0.7, False), ScopeMatch("a", 0.2, False, other_score=0.6),
               ScopeMatch("b", 0.5, False), ScopeMatch("a", 0.4, False), ScopeMatch("a", 0.1, False),
               ScopeMatch("a", 0.45, False)]
    chosen, sweep = calibrate_answerability(records, matches)
    assert chosen.threshold == 0.425  # between the lowest answerable (0.45) and the highest unanswerable (0.4)
    assert (chosen.answerable_kept, chosen.unanswerable_declined) == (1.0, 1.0)
    assert evaluate_answerability(records, matches, 0.55) == type(chosen)(0.55, 0.5, 1.0)
    assert [row.threshold for row in sweep] == sorted((row.threshold for row in sweep), reverse=True)
    looser, _ = calibrate_answerability(records, matches, min_kept=0.75)
    assert looser.threshold == 0.475 and looser.answerable_kept == 0.75


@pytest.mark.integration
def test_a_poll_rereads_the_vectors_only_after_the_index_changed(opensearch_url, embedder):
    with ChunkIndex(opensearch_url, f"it-scope-gen-{uuid.uuid4().hex[:8]}", timeout_s=30, embedder=embedder) as index:
        index.ensure_index()
        index.upsert(CHUNKS[:3])
        detector = ScopeDetector(index, THRESHOLD)
        assert detector.refresh() == 3
        assert detector.refresh(if_changed=True) is None  # nothing written: one stats request, no scan
        assert detector.refresh(["hr-handbook"], if_changed=True) == 2  # another release's documents: reread

        passwords = embedder.encode_query("How often must passwords be rotated?")
        assert detector.cite("hr-handbook", passwords).chunk_id != "vpn-2"
        index.upsert([replace(CHUNKS[3], doc_id="hr-handbook")])  # a new chunk
        assert detector.refresh(["hr-handbook"], if_changed=True) == 3
        assert detector.cite("hr-handbook", passwords).chunk_id == "vpn-2"
        assert detector.refresh(["hr-handbook"], if_changed=True) is None

        canteen = embedder.encode_query("What does the canteen serve on Friday?")
        before = detector.cite("hr-handbook", canteen).score
        index.upsert([replace(CHUNKS[5], chunk_id="leave-2", doc_id="hr-handbook", tier="fixed")])  # replaced in place
        assert detector.refresh(["hr-handbook"], if_changed=True) == 3
        cited = detector.cite("hr-handbook", canteen)
        assert cited.chunk_id == "leave-2" and cited.score > before + 0.05


ALARM_CHUNKS = [
    Chunk("alarms-1", "ops-manual", "What each alarm means: alarms E-401/E-402 mean the VPN tunnel is down or the "
          "disk is nearly full; alarm E-403 means a sensor stopped reporting; alarm E-405 means the clock drifted.",
          tier="fixed", version="2", title="Operations manual", section="Alarm meanings"),
    Chunk("notes-1", "release-3-2", "Version 3.2 upgrades the bundled Kafka client, adds Chinese language packs "
          "to the console, speeds up report exports and brings E-416 for licences that expire soon.",
          tier="variable", version="3.2", title="Release notes 3.2", section="Changes"),
]


@pytest.mark.integration
def test_an_identifier_only_another_document_holds_keeps_a_question_from_the_cache(opensearch_url, embedder):
    """"What does alarm E-416 mean?" reads like the manual's alarm section, but only the release note
    names E-416: the snapshot could only decline or describe a neighbouring alarm."""
    with ChunkIndex(opensearch_url, f"it-scope-ids-{uuid.uuid4().hex[:8]}", timeout_s=30, embedder=embedder) as index:
        index.ensure_index()
        index.upsert(ALARM_CHUNKS)
        detector = ScopeDetector(index, threshold=0.0)  # every question is close enough: identifiers decide
        detector.refresh()
        question = "What does alarm E-416 mean?"
        vector = embedder.encode_query(question)
        assert detector.match(vector).in_scope  # by similarity alone, the manual would answer
        foreign = detector.match(vector, question)
        assert foreign.elsewhere == ("e-416",) and not foreign.in_scope and foreign.doc_id == "ops-manual"
        assert not foreign.routes_to_cache(0.0)
        # an identifier the matched document holds (here inside a listed pair) keeps the cache route
        held = "What does alarm E-402 mean?"
        assert detector.match(embedder.encode_query(held), held).in_scope
        # an identifier no document holds leaves routing to similarity; grounding declines the answer
        unknown = "What does alarm E-499 mean?"
        match = detector.match(embedder.encode_query(unknown), unknown)
        assert match.elsewhere == () and match.in_scope
        # a Chinese question names the same identifier without spaces around it
        chinese = "告警E-416是什么意思？"
        assert detector.match(embedder.encode_query(chinese), chinese).elsewhere == ("e-416",)
