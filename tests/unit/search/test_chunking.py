"""Chunking: token bounds under the embedding tokenizer, overlap, stable ids, nothing lost or mixed."""

import re

import pytest
from cagflow.documents.parsing import ParsedDocument, Section, parse_file
from cagflow.search.chunking import ChunkingError, chunk_document, embedding_token_counter


def count_words(texts):
    return [len(text.split()) for text in texts]


def sentences(n: int, words: int = 5) -> str:
    return " ".join(f"Sentence {i} has " + " ".join(["word"] * (words - 3)) + "." for i in range(n))


@pytest.fixture(scope="module")
def count_tokens():
    return embedding_token_counter()


def test_ids_are_stable_and_numbered_in_reading_order():
    document = ParsedDocument("Guide", (Section("Intro", sentences(12)), Section("Usage", sentences(6))))
    first = chunk_document("guide", "1.2.0", "fixed", document, count_words, max_tokens=20, overlap_tokens=5)
    again = chunk_document("guide", "1.2.0", "fixed", document, count_words, max_tokens=20, overlap_tokens=5)
    assert first == again
    assert [c.chunk_id for c in first] == [f"guide:1.2.0:{n}" for n in range(len(first))]
    assert {c.section for c in first} == {"Intro", "Usage"}
    assert all(c.title == "Guide" and c.tier == "fixed" and c.version == "1.2.0" for c in first)


def test_windows_respect_the_limit_and_overlap_by_whole_sentences():
    text = sentences(20)  # 5 words each
    chunks = chunk_document("d", "1", "fixed", ParsedDocument("T", (Section("S", text),)), count_words,
                            max_tokens=20, overlap_tokens=5)
    assert all(c.n_tokens <= 20 for c in chunks)
    for previous, current in zip(chunks, chunks[1:]):
        last_sentence = re.findall(r"Sentence \d+ [^.]*\.", previous.text)[-1]
        assert current.text.startswith(last_sentence)  # one 5-word sentence of overlap
    covered = " ".join(c.text for c in chunks)
    assert all(f"Sentence {i} " in covered for i in range(20))


def test_chunks_never_cross_sections_and_keep_original_text():
    document = ParsedDocument("T", (Section("A", sentences(3)), Section("B", "- item one\n- item two\n- item three")))
    chunks = chunk_document("d", "1", "variable", document, count_words, max_tokens=8, overlap_tokens=0)
    for chunk in chunks:
        source = next(s.text for s in document.sections if s.heading == chunk.section)
        assert chunk.text in source
    assert [c.text for c in chunks if c.section == "B"] == ["- item one\n- item two", "- item three"]


def test_a_sentence_longer_than_the_window_is_split_at_words():
    long_sentence = " ".join(f"w{i}" for i in range(95)) + "."
    chunks = chunk_document("d", "1", "fixed", ParsedDocument("T", (Section("", long_sentence),)), count_words,
                            max_tokens=10, overlap_tokens=2)
    assert all(1 <= c.n_tokens <= 10 for c in chunks)
    assert " ".join(c.text for c in chunks).split() == long_sentence.split()


def test_chinese_sentences_end_at_full_width_punctuation_and_overlap():
    text = "".join(f"第{i}句话说明一件事情。" for i in range(12)) + "“引用的话。”最后一句？"
    count_chars = lambda texts: [len(t) for t in texts]  # noqa: E731 - one token per character
    chunks = chunk_document("d", "1", "fixed", ParsedDocument("T", (Section("S", text),)), count_chars,
                            max_tokens=40, overlap_tokens=12)
    assert all(c.n_tokens <= 40 for c in chunks) and len(chunks) > 3
    for previous, current in zip(chunks, chunks[1:]):
        assert previous.text.endswith(("。", "”", "？"))  # cut between sentences, never inside one
        assert current.text.startswith(re.findall(r"[^。？”]+[。？]”?", previous.text)[-1])  # one sentence overlap
    assert chunks[-1].text.endswith("“引用的话。”最后一句？")


def test_a_long_chinese_sentence_is_split_at_its_commas():
    sentence = "，".join(f"第{i}个分句" for i in range(30)) + "。"
    count_chars = lambda texts: [len(t) for t in texts]  # noqa: E731
    chunks = chunk_document("d", "1", "fixed", ParsedDocument("T", (Section("", sentence),)), count_chars,
                            max_tokens=20, overlap_tokens=0)
    assert all(c.n_tokens <= 20 for c in chunks)
    assert all(c.text.endswith(("，", "。")) for c in chunks)  # whole clauses
    assert "".join(c.text for c in chunks) == sentence


def test_a_single_giant_word_is_cut_to_fit(count_tokens):
    blob = "QmFzZTY0" * 400
    chunks = chunk_document("d", "1", "fixed", ParsedDocument("T", (Section("", blob),)), count_tokens,
                            max_tokens=64, overlap_tokens=8)
    assert all(1 <= c.n_tokens <= 64 for c in chunks)
    assert "".join(c.text for c in chunks) == blob


def test_blank_sections_give_no_chunks():
    document = ParsedDocument("T", (Section("Empty", "   \n  "),))
    assert chunk_document("d", "1", "fixed", document, count_words) == []


@pytest.mark.parametrize("size, overlap", [(10, 10), (10, 12), (0, 0), (10, -1)])
def test_impossible_settings_are_refused(size, overlap):
    with pytest.raises(ChunkingError, match="overlap"):
        chunk_document("d", "1", "fixed", ParsedDocument("T", (Section("", "x."),)), count_words, size, overlap)


def test_sample_corpus_chunks_fit_the_embedding_window(corpus, count_tokens):
    for entry in corpus.documents:
        document = parse_file(corpus.file(entry), entry.title)
        chunks = chunk_document(entry.doc_id, entry.version, entry.tier, document, count_tokens, 200, 40)
        assert chunks, entry.doc_id
        assert all(1 <= c.n_tokens <= 200 for c in chunks), entry.doc_id
        assert len({c.chunk_id for c in chunks}) == len(chunks)
        recounted = count_tokens([c.text for c in chunks])
        assert recounted == [c.n_tokens for c in chunks]
