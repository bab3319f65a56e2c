"""The engine on a tiny random model: answers from a snapshot must be token-identical to the full prompt."""

import threading

import pytest
import torch
from cagflow.documents.parsing import ParsedDocument, Section, parse_file
from cagflow.engine.answers import Answer, closest_part
from cagflow.engine.engine import Engine, SnapshotMismatch
from cagflow.engine.parts import DocumentPart
from cagflow.config import RelevanceConfig
from cagflow.answering.prompt import DECLINED_ANSWER, WORDINGS, EmptyQuestionError, Passage, PromptError
from cagflow.documents.snapshot import Snapshot
from cagflow.inference.resident import load_snapshot
from cagflow.offline.precompute import plan_parts, precompute_part
from cagflow.store.backends import LocalStore
from cagflow.store.manifests import SnapshotUnusable

QUESTIONS = ["Which port does the web console use?", "How long are backups kept?", "Who approves a SEV1 change?"]


@pytest.fixture(scope="module")
def small_parts(tiny_engine, corpus):
    """The first part of three documents split to ~600 tokens: realistic text, quick to prefill."""
    engine = Engine(tiny_engine.loaded, max_context_tokens=900, max_new_tokens=24, question_budget_tokens=128)
    parts = []
    for entry in corpus.tier("fixed")[:3]:
        parts.append(engine.split(entry.doc_id, entry.version, parse_file(corpus.file(entry), entry.title))[0])
    return engine, parts


def test_cache_path_is_exact_after_store_round_trip(small_parts, tmp_path):
    engine, parts = small_parts
    store = LocalStore(tmp_path)
    for part in parts:
        entry = precompute_part(engine, store, part).entry
        snapshot = load_snapshot(store, entry)
        for question in QUESTIONS:
            cached = engine.suffix_logits(question, snapshot)
            full = engine.suffix_logits(question, snapshot, reuse_cache=False)
            assert torch.allclose(cached, full, atol=1e-4), (part.doc_id, question, (cached - full).abs().max())
            via_cache = engine.answer(question, snapshot=snapshot)
            via_full = engine.answer(question, snapshot=snapshot, reuse_cache=False)
            assert via_cache.token_ids == via_full.token_ids
            assert via_cache.route == "cache" and via_full.route == "full"
            assert via_cache.reused_tokens == snapshot.n_tokens == entry.n_tokens
            assert via_full.reused_tokens == 0 and via_cache.prompt_tokens == via_full.prompt_tokens


UPDATES = (Passage("The web console now listens on port 9443 instead of 8443.", "Skerry 5.4.0 Release Notes",
                  "Changes", "2025-03-10"), Passage("Backups are now kept for 60 days."))


def test_cache_with_newer_passages_is_exact_against_the_full_prompt(small_parts):
    engine, parts = small_parts
    snapshot = engine.precompute(parts[0])
    for question in QUESTIONS[:2]:
        via_cache = engine.answer(question, snapshot=snapshot, context=UPDATES)
        via_full = engine.answer(question, snapshot=snapshot, context=UPDATES, reuse_cache=False)
        assert via_cache.route == "cache+retrieval" and via_full.route == "full"
        assert via_cache.token_ids == via_full.token_ids
        assert via_cache.reused_tokens == snapshot.n_tokens and via_cache.prompt_tokens == via_full.prompt_tokens
        plain = engine.answer(question, snapshot=snapshot)
        assert via_cache.prompt_tokens > plain.prompt_tokens  # the passages are part of the suffix
        streamed = list(engine.stream(question, snapshot=snapshot, context=UPDATES))
        assert streamed[-1].token_ids == via_full.token_ids
        cached = engine.suffix_logits(question, snapshot, updates=UPDATES)
        full = engine.suffix_logits(question, snapshot, reuse_cache=False, updates=UPDATES)
        assert cached.shape[0] == via_cache.prompt_tokens - snapshot.n_tokens
        assert torch.allclose(cached, full, atol=1e-4), (question, (cached - full).abs().max())


def test_newer_passages_stand_between_the_document_and_the_question(small_parts):
    engine, parts = small_parts
    snapshot = engine.precompute(parts[0])
    _, ids, reused, _ = engine._plan(QUESTIONS[0], snapshot, UPDATES, True)
    suffix = engine.tokenizer.decode(ids[reused:])
    assert ids[:reused] == snapshot.prefix_token_ids
    assert "[Newer text] The web console now listens" in suffix and "2025-03-10" not in suffix
    assert suffix.index("9443") < suffix.index(QUESTIONS[0]) < suffix.index("a newer text overrides the document")


def test_answering_never_mutates_a_shared_snapshot(small_parts):
    engine, parts = small_parts
    snapshot = engine.precompute(parts[0])
    before = [t.clone() for t in snapshot.keys + snapshot.values]
    pointers = [t.data_ptr() for t in snapshot.keys + snapshot.values]
    results: dict[int, list[int]] = {}

    def ask(index: int) -> None:
        results[index] = engine.answer(QUESTIONS[index % 3], snapshot=snapshot).token_ids

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(6):
        assert results[index] == engine.answer(QUESTIONS[index % 3], snapshot=snapshot).token_ids
    assert [t.data_ptr() for t in snapshot.keys + snapshot.values] == pointers
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot.keys + snapshot.values))


def test_stream_yields_the_answer_text_then_the_record(small_parts):
    engine, parts = small_parts
    snapshot = engine.precompute(parts[1])
    items = list(engine.stream(QUESTIONS[0], snapshot=snapshot))
    record = items[-1]
    assert isinstance(record, Answer)
    assert all(isinstance(piece, str) for piece in items[:-1])
    assert "".join(items[:-1]).strip() == record.text
    assert record.ttft_s <= record.total_s and record.finish_reason in ("eos", "length")


def test_retrieval_and_question_only_routes(small_parts):
    engine, _ = small_parts
    answer = engine.answer("Which port?", context=[Passage("The console listens on 8443.", "Manual", "Ports")])
    assert answer.route == "retrieval" and answer.reused_tokens == 0 and answer.token_ids
    assert engine.answer("Which port?").route == "question-only"
    with pytest.raises(EmptyQuestionError):
        engine.answer("  ", context=[Passage("x")])


def test_relevance_check_shares_the_answers_prefix_and_declines_below_its_threshold(small_parts):
    engine, parts = small_parts
    snapshot = engine.precompute(parts[0])
    passages = [Passage("The console listens on 8443.", "Manual", "Ports")]
    prefix = (snapshot.keys, snapshot.values) if engine.fast is not None else None
    from_snapshot = engine.relevance(QUESTIONS[0], snapshot, reused=snapshot.n_tokens, prefix=prefix)
    assert 0.0 <= from_snapshot <= 1.0
    assert engine.relevance(QUESTIONS[0], snapshot) == pytest.approx(from_snapshot, abs=1e-5)  # prefix computed here
    # an answer is checked with its own words
    given = engine.answer(QUESTIONS[0], snapshot=snapshot).text
    checked = engine.relevance(QUESTIONS[0], snapshot, reused=snapshot.n_tokens, prefix=prefix, answer=given)
    assert 0.0 <= checked <= 1.0 and checked != pytest.approx(from_snapshot, abs=1e-6)

    threshold = (checked + 1.0) / 2  # just above what the model says of this answer
    strict = Engine(engine.loaded, engine.max_context_tokens, engine.max_new_tokens, engine.question_budget_tokens,
                    RelevanceConfig(decline_below_en=threshold))
    for answer in (strict.answer(QUESTIONS[0], snapshot=snapshot),
                   strict.answer(QUESTIONS[0], snapshot=snapshot, reuse_cache=False),
                   strict.answer_batch(QUESTIONS[:1], snapshot)[0]):
        if answer.decline_reason not in (None, "model_declined", "not_in_documents"):  # grounding declined it
            assert answer.relevance is None
            continue
        assert answer.relevance == pytest.approx(from_snapshot if answer.decline_reason == "model_declined"
                                                 else checked, abs=1e-5)
        if answer.decline_reason != "model_declined":
            assert answer.text == given
            assert not answer.answered and answer.not_relevant and answer.decline_reason == "not_in_documents"
    retrieval = strict.answer("Which port?", context=passages)
    if retrieval.relevance is not None and retrieval.decline_reason != "model_declined":
        assert retrieval.answered == (retrieval.relevance >= threshold)
    assert strict.answer("Which port?").relevance is None  # a question alone has no text to check against
    assert engine.answer(QUESTIONS[0], snapshot=snapshot).relevance is None  # no relevance check configured


def _declining_where(marker: str, declined: list[int], prompts: list[str] | None = None):
    """An ``Engine._greedy`` that decodes the decline sentence for every prompt holding ``marker`` and the
    model's own tokens otherwise: the tiny model never declines by itself. ``prompts`` collects every prompt."""
    decode = Engine._greedy

    def greedy(self, ids, *args, **kwargs):
        text = self.tokenizer.decode(ids)
        if prompts is not None:
            prompts.append(text)
        if marker in text:
            yield from [*declined, *self.eos_ids]
        else:
            yield from decode(self, ids, *args, **kwargs)

    return greedy


def test_a_decline_the_relevance_check_overrules_is_asked_again_and_never_shown(small_parts, monkeypatch):
    """The tiny model never declines by itself: make every first attempt the decline sentence, and the check
    say "yes", then the answer is the second attempt's (without the option to decline), streamed alone."""
    engine, parts = small_parts
    snapshot = engine.precompute(parts[0])
    lenient = Engine(engine.loaded, engine.max_context_tokens, engine.max_new_tokens, engine.question_budget_tokens,
                     RelevanceConfig(decline_below_en=0.0, reask_from_en=0.0, reask_en="answer"))
    plain = lenient.answer(QUESTIONS[0], snapshot=snapshot)
    assert plain.answered and not plain.reasked and plain.relevance is None  # declining is off: not asked
    relevance = lenient.relevance(QUESTIONS[0], snapshot)
    declined = lenient.tokenizer(DECLINED_ANSWER, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(Engine, "_greedy", _declining_where(WORDINGS["en"].question_reminder, declined))
    for reuse_cache in (True, False):
        items = list(lenient.stream(QUESTIONS[0], snapshot=snapshot, reuse_cache=reuse_cache))
        answer = items[-1]
        assert answer.reasked and answer.relevance == pytest.approx(relevance, abs=1e-5)
        assert DECLINED_ANSWER not in "".join(items[:-1])  # the held-back decline never reached the stream
        assert "".join(items[:-1]).strip() == answer.text and answer.text != DECLINED_ANSWER

    def every_row_declines(self, suffixes, *args, **kwargs):
        for token in [*declined, next(iter(self.eos_ids))]:
            yield {row: token for row in range(len(suffixes))}

    monkeypatch.setattr(Engine, "_greedy_rows", every_row_declines)
    batched = lenient.answer_batch(QUESTIONS[0:1], snapshot)[0]
    assert batched.reasked and batched.token_ids == answer.token_ids and batched.answered == answer.answered
    never = Engine(engine.loaded, engine.max_context_tokens, engine.max_new_tokens, engine.question_budget_tokens,
                   RelevanceConfig(decline_below_en=0.0, reask_from_en=1.1))
    items = list(never.stream(QUESTIONS[0], snapshot=snapshot))
    assert items[-1].decline_reason == "model_declined" and not items[-1].reasked
    assert "".join(items[:-1]).strip() == DECLINED_ANSWER  # a decline that stands is shown once it is known


def test_a_decline_is_asked_again_with_the_closest_section_quoted_within_the_question_budget(small_parts,
                                                                                             monkeypatch):
    """"excerpt" re-asks quote the section sharing the most words with the question ahead of it, cut to the
    question budget, over the snapshot's prefix (exact against the full prompt), and may decline again."""
    engine, parts = small_parts
    snapshot = engine.precompute(parts[0])
    excerpting = Engine(engine.loaded, engine.max_context_tokens, engine.max_new_tokens, engine.question_budget_tokens,
                        RelevanceConfig(reask_from_en=0.0, reask_en="excerpt"))
    declined = engine.tokenizer(DECLINED_ANSWER, add_special_tokens=False)["input_ids"]
    prompts = []
    monkeypatch.setattr(Engine, "_greedy", _declining_where(WORDINGS["en"].question_reminder, declined, prompts))
    question = "Which port does the web console listen on?"
    cached = excerpting.answer(question, snapshot=snapshot)
    full = excerpting.answer(question, snapshot=snapshot, reuse_cache=False)
    assert cached.reasked and cached.route == "cache" and full.route == "full"
    assert cached.token_ids == full.token_ids and cached.text != DECLINED_ANSWER
    reasked = prompts[1]
    assert reasked.startswith(excerpting.prompts.prefix_text(snapshot.system_prompt))
    user_turn = reasked[len(excerpting.prompts.prefix_text(snapshot.system_prompt)):]
    assert WORDINGS["en"].excerpt_label in user_turn and WORDINGS["en"].excerpt_reminder in user_turn
    quoted = user_turn.split(WORDINGS["en"].excerpt_label, 1)[1].split(question)[0].strip().removesuffix("…").strip()
    closest = closest_part(question, snapshot, None)
    assert len(quoted) > 40 and closest.startswith(quoted) and quoted in snapshot.system_prompt
    assert "console" in closest.lower()
    assert cached.prompt_tokens - cached.reused_tokens <= excerpting.question_budget_tokens

    # the re-ask keeps the option to decline: one that declines again stands, as the model's decline
    monkeypatch.setattr(Engine, "_greedy", _declining_where(question, declined))
    again = excerpting.answer(question, snapshot=snapshot)
    assert again.reasked and again.decline_reason == "model_declined"


def test_a_question_about_a_document_alone_is_asked_with_its_closest_sentences_quoted(small_parts, monkeypatch):
    """focus_tokens: over a snapshot, the document's sentences sharing the most with the question are quoted
    ahead of it (the prefix unchanged, so the cache route stays exact against the full prompt); never with
    newer passages, and not when the quote would overflow the question budget."""
    engine, parts = small_parts
    snapshot = engine.precompute(parts[0])
    focused = Engine(engine.loaded, engine.max_context_tokens, engine.max_new_tokens, engine.question_budget_tokens,
                     focus_tokens=48)
    prompts = []
    monkeypatch.setattr(Engine, "_greedy", _declining_where("\x00never", [], prompts))
    question = "Which port does the web console listen on?"
    cached = focused.answer(question, snapshot=snapshot)
    full = focused.answer(question, snapshot=snapshot, reuse_cache=False)
    assert cached.token_ids == full.token_ids and cached.prompt_tokens == full.prompt_tokens
    user_turn = prompts[0][len(focused.prompts.prefix_text(snapshot.system_prompt)):]
    quoted = user_turn.split(WORDINGS["en"].excerpt_label, 1)[1].split(question)[0].strip()
    assert "console" in quoted.lower() and len(focused.prompts.encode(quoted)) <= 48 + 4
    assert all(sentence.strip("… ") in snapshot.system_prompt for sentence in quoted.split("…"))
    assert cached.prompt_tokens > engine.answer(question, snapshot=snapshot).prompt_tokens

    prompts.clear()
    focused.answer(question, snapshot=snapshot, context=UPDATES)
    assert WORDINGS["en"].excerpt_label not in prompts[0]
    tight = Engine(engine.loaded, engine.max_context_tokens, engine.max_new_tokens, 60, focus_tokens=48)
    assert tight.answer(question, snapshot=snapshot).prompt_tokens == engine.answer(question, snapshot=snapshot).prompt_tokens


def test_the_closest_part_is_weighed_by_its_rare_terms():
    """Words most parts hold ("how", "the", "does") weigh less than the ones few hold: as many terms in common
    with the question, the part holding the rare ones is quoted."""
    fillers = [Passage(f"How the team does a task of kind {n}.") for n in range(5)]
    target = Passage("Nobody may acknowledge a SEV1 page late.")
    assert closest_part("How does the engineer acknowledge a SEV1 page?", None, [*fillers, target]) == target.text
    assert closest_part("anything", None, []) == ""


def test_a_decline_next_to_newer_passages_is_answered_by_the_document_alone(small_parts, monkeypatch):
    """The tiny model never declines by itself: make every attempt with newer passages the decline sentence;
    the answer is then the document's own (token-identical to the snapshot asked alone, on the cache and the
    full route), and the decline never reaches the stream."""
    engine, parts = small_parts
    snapshot = engine.precompute(parts[0])
    alone = engine.answer(QUESTIONS[0], snapshot=snapshot)
    declined = engine.tokenizer(DECLINED_ANSWER, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(Engine, "_greedy", _declining_where(WORDINGS["en"].newer_label, declined))
    for reuse_cache, route in ((True, "cache"), (False, "full")):
        items = list(engine.stream(QUESTIONS[0], snapshot=snapshot, context=UPDATES, reuse_cache=reuse_cache))
        answer = items[-1]
        assert answer.route == route and answer.token_ids == alone.token_ids and answer.answered == alone.answered
        assert "".join(items[:-1]).strip() == answer.text and DECLINED_ANSWER not in "".join(items[:-1])


def test_long_document_is_split_by_section_without_losing_text(tiny_engine, corpus):
    engine = Engine(tiny_engine.loaded, max_context_tokens=700, max_new_tokens=32, question_budget_tokens=64)
    entry = corpus.tier("fixed")[0]
    document = parse_file(corpus.file(entry), entry.title)
    parts = engine.split(entry.doc_id, entry.version, document)
    assert len(parts) > 2
    assert [p.part for p in parts] == list(range(1, len(parts) + 1))
    for part in parts:
        assert len(engine.prompts.prefix_ids(part.system)) <= engine.prefix_budget
    original_words = " ".join(s.render() for s in document.sections).split()
    split_words = " ".join(s.render() for p in parts for s in p.sections).split()
    assert [w for w in original_words if not w.startswith("#")] == [w for w in split_words if not w.startswith("#")]


def test_one_huge_section_is_cut_at_paragraphs(tiny_engine):
    engine = Engine(tiny_engine.loaded, max_context_tokens=400, max_new_tokens=16, question_budget_tokens=32)
    paragraphs = [f"Paragraph {i} says the limit is {i * 7} units." for i in range(120)]
    document = ParsedDocument("Big", (Section("Only", "\n\n".join(paragraphs)),))
    parts = engine.split("big", "1.0.0", document)
    assert len(parts) > 1
    text = "\n\n".join(s.text for p in parts for s in p.sections)
    assert all(paragraph in text for paragraph in paragraphs)


def test_fits_whole_when_it_can(tiny_engine, corpus):
    parts = plan_parts(tiny_engine, corpus)
    assert list(dict.fromkeys(p.doc_id for p in parts)) == [e.doc_id for e in corpus.tier("fixed")]
    # the English documents fit the tiny engine's context whole; the Chinese ones (about two of its tokens
    # per character) are cut into parts at sections
    english = [p for p in parts if not p.doc_id.startswith("yunfan-")]
    assert english and all(p.part is None for p in english)
    assert all(p.part is not None for p in parts if p.doc_id.startswith("yunfan-"))


def test_snapshot_of_another_model_is_refused(small_parts):
    engine, parts = small_parts
    snapshot = engine.precompute(parts[0])
    foreign = Snapshot(snapshot.doc_id, snapshot.doc_version, None, "f" * 64, snapshot.prefix_token_ids,
                       snapshot.keys, snapshot.values, system_prompt=snapshot.system_prompt)
    with pytest.raises(SnapshotMismatch, match="built by model ffffffffffffffff"):
        engine.answer("What?", snapshot=foreign)


def test_prompt_longer_than_context_is_refused(tiny_engine):
    engine = Engine(tiny_engine.loaded, max_context_tokens=300, max_new_tokens=16, question_budget_tokens=32)
    with pytest.raises(PromptError, match="exceed the budget"):
        engine.precompute(DocumentPart("d", "1.0.0", "T", (Section("S", "word " * 2000),)))


def test_precompute_is_idempotent_and_versions_never_overwrite(small_parts, tmp_path):
    engine, parts = small_parts
    store = LocalStore(tmp_path)
    first = precompute_part(engine, store, parts[0])
    objects = sorted(info.name for info in store.list())
    again = precompute_part(engine, store, parts[0])
    assert not first.skipped and again.skipped
    assert again.entry == first.entry
    assert sorted(info.name for info in store.list()) == objects

    bumped = DocumentPart(parts[0].doc_id, "9.9.9", parts[0].title, parts[0].sections)
    new = precompute_part(engine, store, bumped)
    assert new.entry.key != first.entry.key and new.entry.doc_version == "9.9.9"
    assert store.get(first.entry.object_name, sha256=first.entry.sha256)


def test_damaged_snapshot_is_recomputed_or_reported(small_parts, tmp_path):
    engine, parts = small_parts
    store = LocalStore(tmp_path)
    entry = precompute_part(engine, store, parts[0]).entry
    path = tmp_path / entry.object_name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotUnusable, match="corrupt"):
        load_snapshot(store, entry)
    with pytest.raises(SnapshotUnusable, match="does not verify"):
        precompute_part(engine, store, parts[0])
    path.unlink()
    with pytest.raises(SnapshotUnusable, match="missing"):
        load_snapshot(store, entry)


def test_the_part_to_answer_from_shares_the_most_words_or_chinese_character_pairs():
    from cagflow.documents.text import best_part

    parts = ["第一章 总则 本制度适用于全体员工。", "第三章 账号 密码长度不得少于 14 位，每 120 天更换。", "Ports: 8443."]
    assert best_part("密码最少需要几位？", parts) == 1
    assert best_part("Which ports are open?", parts) == 2
    assert best_part("nothing shared", parts) == 0  # ties: the first
