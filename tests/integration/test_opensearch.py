"""Retrieval against a real OpenSearch node started by the test session (k-NN + neural-search)."""

import socket
import uuid

import pytest
from cagflow.devstack.opensearch import PLUGIN_NAMES, free_port
from cagflow.search.embeddings import get_embedder
from cagflow.search.fusion import Fusion
from cagflow.search.index_schema import Chunk
from cagflow.search.retrieval import ChunkIndex, RetrievalError, RetrievalUnavailable, SearchMode

pytestmark = pytest.mark.integration

CHUNKS = [
    Chunk("hr-1", "hr-handbook", "Full-time employees receive 25 days of paid annual leave per calendar year. "
          "Unused leave days can be carried over until March 31.", tier="fixed", version="3", title="HR handbook",
          section="Leave"),
    Chunk("hr-2", "hr-handbook", "Sick leave requires a medical certificate from the third day of absence.",
          tier="fixed", version="3", title="HR handbook", section="Sickness"),
    Chunk("it-1", "it-guide", "To connect to the corporate VPN, install the WireGuard client and import the "
          "configuration file from the IT portal.", tier="fixed", version="7", title="IT guide",
          section="Remote access"),
    Chunk("it-2", "it-guide", "Passwords must be rotated every 90 days and contain at least 14 characters.",
          tier="fixed", version="7", title="IT guide", section="Accounts"),
    Chunk("travel-1", "travel-policy", "Economy class is mandatory for flights shorter than six hours; business "
          "class needs director approval.", tier="fixed", version="1", title="Travel policy", section="Flights"),
    Chunk("travel-2", "travel-policy", "Submit expense reports with all receipts within 30 days after the trip.",
          tier="fixed", version="1", title="Travel policy", section="Expenses"),
    Chunk("menu-1", "canteen-menu", "This week the canteen serves vegetable lasagna on Monday and grilled salmon "
          "on Friday.", tier="variable", version="2026-w49", title="Canteen menu", section="This week"),
    Chunk("status-1", "service-status", "The payroll system is down for maintenance on Saturday from 08:00 to "
          "12:00 UTC.", tier="variable", version="2026-12-02", title="Service status", section="Maintenance"),
]

QUESTIONS = [
    ("How many days of annual leave do full-time employees get?", "hr-1"),
    ("How do I connect to the VPN from home?", "it-1"),
    ("What food does the canteen serve this week?", "menu-1"),
    ("When is the payroll system offline for maintenance?", "status-1"),
]


@pytest.fixture(scope="session")
def embedder():
    return get_embedder()


@pytest.fixture(scope="module")
def loaded_index(opensearch_url, embedder):
    with ChunkIndex(opensearch_url, "it-chunks", top_k=3, timeout_s=30, embedder=embedder) as index:
        index.ensure_index()
        index.upsert(CHUNKS)
        yield index


@pytest.fixture
def fresh_index(opensearch_url, embedder):
    with ChunkIndex(opensearch_url, f"it-{uuid.uuid4().hex[:8]}", timeout_s=30, embedder=embedder) as index:
        index.ensure_index()
        yield index


def test_node_reports_plugins_and_server_side_hybrid(loaded_index):
    health = loaded_index.health()
    assert health["status"] in ("green", "yellow")
    assert set(PLUGIN_NAMES) <= set(health["plugins"])
    assert health["hybrid"] == "server" and health["rrf"] == "server"
    assert health["alias_exists"]


def test_mapping_is_created_behind_an_alias(fresh_index, opensearch_url):
    physical = fresh_index.ensure_index()
    assert physical != fresh_index.alias
    assert fresh_index.ensure_index() == physical
    mapping = fresh_index._client.indices.get_mapping(index=fresh_index.alias)[physical]["mappings"]["properties"]
    assert mapping["embedding"]["type"] == "knn_vector"
    assert mapping["embedding"]["dimension"] == 384
    assert mapping["embedding"]["method"]["engine"] == "lucene"
    assert mapping["embedding"]["method"]["space_type"] == "cosinesimil"
    assert mapping["text"]["type"] == "text"
    for keyword in ("chunk_id", "doc_id", "tier", "version"):
        assert mapping[keyword]["type"] == "keyword"


def test_upsert_is_idempotent_by_chunk_id(fresh_index):
    chunk = CHUNKS[0]
    fresh_index.upsert([chunk])
    fresh_index.upsert([chunk])
    assert fresh_index.count(doc_id=chunk.doc_id) == 1
    revised = Chunk(chunk.chunk_id, chunk.doc_id, "Employees receive 30 days of annual leave.", tier="fixed",
                    version="4")
    fresh_index.upsert([revised])
    assert fresh_index.count() == 1
    [hit] = fresh_index.search("annual leave", mode=SearchMode.BM25)
    assert hit.version == "4" and "30 days" in hit.text


def test_delete_by_doc_id_removes_only_that_document(fresh_index):
    fresh_index.upsert(CHUNKS)
    assert fresh_index.delete_document("it-guide") == 2
    assert fresh_index.count(doc_id="it-guide") == 0
    assert fresh_index.count() == len(CHUNKS) - 2
    assert fresh_index.delete_document("it-guide") == 0


def test_rebuild_switches_the_alias_atomically(fresh_index):
    first = fresh_index.ensure_index()
    fresh_index.upsert(CHUNKS[:2])
    second = fresh_index.rebuild(CHUNKS)
    assert second != first
    assert fresh_index._alias_targets() == [second]
    assert not fresh_index._client.indices.exists(index=first)
    assert fresh_index.count() == len(CHUNKS)


@pytest.mark.parametrize("mode", list(SearchMode))
@pytest.mark.parametrize("question,expected", QUESTIONS)
def test_each_mode_finds_the_expected_chunk(loaded_index, mode, question, expected):
    hits = loaded_index.search(question, mode=mode)
    assert hits, f"{mode.value} found nothing for {question!r}"
    assert hits[0].chunk_id == expected, [hit.chunk_id for hit in hits]
    assert [hit.score for hit in hits] == sorted((hit.score for hit in hits), reverse=True)


@pytest.mark.parametrize("fusion", list(Fusion))
@pytest.mark.parametrize("hybrid_mode", ["server", "client"])
@pytest.mark.parametrize("question,expected", QUESTIONS)
def test_hybrid_fusions_agree_on_the_top_chunk(
    opensearch_url, loaded_index, embedder, hybrid_mode, fusion, question, expected
):
    with ChunkIndex(
        opensearch_url, loaded_index.alias, top_k=3, timeout_s=30, hybrid_mode=hybrid_mode, embedder=embedder
    ) as index:
        hits = index.search(question, mode=SearchMode.HYBRID, fusion=fusion)
    assert hits[0].chunk_id == expected, [hit.chunk_id for hit in hits]


@pytest.mark.parametrize("mode", list(SearchMode))
def test_tier_filter(loaded_index, mode):
    variable_hits = loaded_index.search("How many days of annual leave do employees get?", mode=mode, tier="variable")
    assert all(hit.tier == "variable" for hit in variable_hits)
    assert "hr-1" not in {hit.chunk_id for hit in variable_hits}
    fixed_hits = loaded_index.search("What food does the canteen serve this week?", mode=mode, tier="fixed", top_k=8)
    assert fixed_hits and all(hit.tier == "fixed" for hit in fixed_hits)


@pytest.mark.parametrize("mode", list(SearchMode))
def test_doc_id_filter(loaded_index, mode):
    hits = loaded_index.search("annual leave and passwords", mode=mode, doc_id="it-guide", top_k=8)
    assert hits and {hit.doc_id for hit in hits} == {"it-guide"}


def test_missing_alias_is_a_plain_retrieval_error(opensearch_url, embedder):
    with ChunkIndex(opensearch_url, "it-no-such-alias", embedder=embedder, timeout_s=3) as index:
        with pytest.raises(RetrievalError) as raised:
            index.search("anything", mode=SearchMode.BM25)
    assert not isinstance(raised.value, RetrievalUnavailable)


@pytest.mark.timeout(60)
def test_a_node_gone_away_raises_unavailable(opensearch_url, forwarder, embedder):
    """The node reached, then gone (its port closed, its connections cut): every call says unavailable, after
    the retries its time budget allows (``tests/unit/search``), instead of hanging or failing otherwise."""
    node = forwarder(opensearch_url)
    node.open()
    with ChunkIndex(node.url, "it-gone", embedder=embedder, timeout_s=60) as setup:
        setup.ensure_index()
        setup.upsert(CHUNKS[:1])
    index = ChunkIndex(node.url, "it-gone", embedder=embedder, timeout_s=2.0, max_retries=3)
    index.describe()
    node.close()
    for call in (lambda: index.search("annual leave"), index.health, lambda: index.upsert(CHUNKS[:1])):
        with pytest.raises(RetrievalUnavailable, match=r"unavailable after \d+ attempt\(s\) within 2 s"):
            call()
    index.close()


@pytest.mark.timeout(60)
def test_unresponsive_server_raises_unavailable(embedder):
    """A port that accepts connections but never answers must not hang the caller."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with ChunkIndex(endpoint, "it-silent", embedder=embedder, timeout_s=1.5, max_retries=5) as index:
            with pytest.raises(RetrievalUnavailable, match=r"within 1.5 s: .*[Tt]imed? ?out"):
                index.count()


@pytest.mark.timeout(60)
def test_refused_port_raises_unavailable(embedder):
    with ChunkIndex(f"http://127.0.0.1:{free_port()}", "it-refused", embedder=embedder, timeout_s=2.0) as index:
        with pytest.raises(RetrievalUnavailable, match="unavailable after"):
            index.search("annual leave", mode=SearchMode.BM25)


def test_doctor_sees_a_missing_index_and_empty_tiers_on_a_real_node(opensearch_url, embedder, monkeypatch):
    from cagflow.client.doctor import retrieval_fallback_fails
    from cagflow.config import load_config

    alias = f"it-doctor-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("CAGFLOW__RETRIEVAL__ENDPOINT", opensearch_url)
    monkeypatch.setenv("CAGFLOW__RETRIEVAL__INDEX", alias)
    missing = retrieval_fallback_fails(load_config())
    assert missing.status == "fail" and f"index alias {alias!r} missing" in missing.detail

    with ChunkIndex(opensearch_url, alias, timeout_s=30, embedder=embedder) as index:
        index.ensure_index()
        index.upsert([chunk for chunk in CHUNKS if chunk.tier == "fixed"])
        empty = retrieval_fallback_fails(load_config())
        assert empty.status == "warn" and "6 fixed chunks, 0 variable chunks" in empty.detail
        index.upsert([chunk for chunk in CHUNKS if chunk.tier == "variable"])
    assert retrieval_fallback_fails(load_config()).status == "ok"
