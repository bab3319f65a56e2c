"""The KV-cache engine: precompute a document's snapshot once, answer many questions from it.

Four ways to answer, all greedy and deterministic so they can be compared token for token:
- cache path: the snapshot's KV tensors stand in for the document, only the question is prefilled;
- cache+retrieval: the snapshot as above, then passages of newer documents and the question, prefilled;
- retrieval path: passages go into the prompt and everything is prefilled;
- full prompt: the same prompt as a cache path, prefilled from scratch (the baseline).
A snapshot is never written to or copied: each request keeps only its own question and answer tokens'
keys and values and attends to the snapshot's tensors in place. Two forward passes do this: the int8 engine
(``fastlm``; ``model.precision: q4k`` or ``int8``, Llama and Qwen2 families, bf16 snapshots) and, for ``fp32``,
transformers with ``shared_prefix`` (Llama family; other architectures get a transformers cache built over
the snapshot). Every route of one engine uses the same numeric recipe, so the routes agree token for token.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Sequence

import torch
from transformers import DynamicCache

from .. import rules
from ..answering.prompt import Passage, PromptBuilder, PromptError, passages_system, wording
from ..config import ModelConfig, RelevanceConfig
from ..documents.parsing import ParsedDocument
from ..documents.snapshot import Snapshot
from ..documents.text import focus, language
from ..errors import CagflowError
from .answers import Answer, Decoded, Stages, closest_part, document_body, grounded_answer
from .fastlm import PrefixKV
from .model import LoadedModel, load_model
from .parts import DocumentPart, split_document
from .passage_kv import PassageStates
from .threads import idle_cores
from .shared_prefix import SharedPrefixDecoder
from .shared_prefix import supports as supports_shared_prefix

QUESTION_ONLY_SYSTEM = "You are a support assistant. Answer the user's question in one or two short sentences."


class SnapshotMismatch(CagflowError, ValueError):
    """The snapshot was built for another model or another prompt template: it cannot be reused."""

    code = "snapshot_mismatch"


class Engine:
    """Owns a loaded model; thread-compatible for reads of shared snapshots (torch releases the GIL)."""

    def __init__(self, loaded: LoadedModel, max_context_tokens: int = 8192, max_new_tokens: int = 128,
                 question_budget_tokens: int = 256, relevance: RelevanceConfig | None = None,
                 disabled_rules: Iterable[str] = (), focus_tokens: int = 0,
                 passage_states: PassageStates | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.fast = loaded.fast
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.prompts = PromptBuilder(self.tokenizer)
        limit = getattr(self.config, "max_position_embeddings", None) or max_context_tokens
        self.max_context_tokens = min(max_context_tokens, limit)
        self.max_new_tokens = max_new_tokens
        self.question_budget_tokens = question_budget_tokens
        self.focus_tokens = focus_tokens
        self.relevance_check = relevance if relevance is not None and relevance.enabled else None
        self.disabled_rules = frozenset(rules.check_names(list(disabled_rules)))
        self.eos_ids = loaded.eos_token_ids
        self.prefix_decoder = (SharedPrefixDecoder(self.model)
                               if self.fast is None and supports_shared_prefix(self.model) else None)
        self.passage_states = passage_states  # the retrieval route's reused passage K/V (int8 engine); None: prefill
        self.prompt_lookup = True  # decode one answer by prompt lookup (engine.lookup), where exact

    @classmethod
    def from_config(cls, model: ModelConfig, disabled_rules: Iterable[str] = (),
                    stored_passage: Callable[[str, str], PrefixKV | None] | None = None) -> "Engine":
        """The engine of ``model``; ``disabled_rules``: the config's ``rules.disabled``; ``stored_passage(
        fingerprint, content_key)``: a passage's stored K/V or None (``model.passage_kv: reuse``)."""
        engine = cls(load_model(model.path, model.threads, model.precision), model.max_context_tokens,
                     model.max_new_tokens, model.question_budget_tokens, model.relevance, disabled_rules,
                     model.focus_tokens)
        if model.idle_cores and engine.fast is not None:
            engine.fast.block_threads = idle_cores
        engine.prompt_lookup = model.prompt_lookup
        if model.passage_kv == "reuse" and engine.fast is not None:
            load = (lambda key: stored_passage(engine.fingerprint, key)) if stored_passage is not None else None
            engine.passage_states = PassageStates(engine.fast, engine.fingerprint,
                                                  model.passage_kv_memory_mb * 2**20, load,
                                                  model.passage_kv_recompute)
        return engine

    @property
    def fingerprint(self) -> str:
        return self.loaded.fingerprint

    @property
    def recipe(self) -> str:
        """The numeric recipe (``fp32`` or the int8 engine's), part of the fingerprint."""
        return self.loaded.recipe

    @property
    def prefix_budget(self) -> int:
        """Tokens a document prefix may use: what is left after room for a question and an answer."""
        return self.max_context_tokens - self.max_new_tokens - self.question_budget_tokens

    # ---- documents -------------------------------------------------------------------------------

    def split(self, doc_id: str, doc_version: str, document: ParsedDocument) -> list[DocumentPart]:
        """Pack whole sections into as few parts as fit the prefix budget; never drop text."""
        return split_document(self.prompts, self.prefix_budget, self.max_context_tokens, doc_id, doc_version, document)

    # ---- snapshots -------------------------------------------------------------------------------

    @torch.inference_mode()
    def precompute(self, part: DocumentPart, on_progress: Callable[[int, int], None] | None = None) -> Snapshot:
        """One forward pass over the document prefix; its KV tensors become the snapshot. ``on_progress(done,
        total)`` hears the prefix tokens computed (after each block on the int8 engine, at the end otherwise)."""
        prefix_ids = self.prompts.prefix_ids(part.system)
        if len(prefix_ids) > self.prefix_budget:
            raise PromptError(f"{part.doc_id}: {len(prefix_ids)} prefix tokens exceed the budget of "
                              f"{self.prefix_budget}; split the document first")
        if self.fast is not None:
            keys, values = self.fast.prefill_prefix(prefix_ids, on_progress)
        else:
            cache = self.model(input_ids=torch.tensor([prefix_ids]), cache=DynamicCache(config=self.config),
                               use_cache=True).cache
            keys = [layer.keys[0] for layer in cache.layers]
            values = [layer.values[0] for layer in cache.layers]
            if on_progress is not None:
                on_progress(len(prefix_ids), len(prefix_ids))
        return Snapshot(part.doc_id, part.doc_version, part.part, self.fingerprint, prefix_ids, keys, values,
                        title=part.title, system_prompt=part.system)

    def _cache_from(self, snapshot: Snapshot) -> DynamicCache:
        """A per-request cache over the snapshot's tensors; growing it allocates new tensors, so the
        snapshot itself is never modified."""
        cache = DynamicCache([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in zip(snapshot.keys, snapshot.values)],
                             config=self.config)
        for layer in cache.layers:
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = snapshot.n_tokens  # sliding-window layers track total length
        return cache

    def _check(self, snapshot: Snapshot) -> None:
        if snapshot.model_fingerprint != self.fingerprint:
            raise SnapshotMismatch(f"snapshot {snapshot.key} was built by model {snapshot.model_fingerprint[:16]}, "
                                   f"this engine runs {self.fingerprint[:16]}")
        if len(snapshot.keys) != self.config.num_hidden_layers:
            raise SnapshotMismatch(f"snapshot {snapshot.key} has {len(snapshot.keys)} layers, model has "
                                   f"{self.config.num_hidden_layers}")

    # ---- answering -------------------------------------------------------------------------------

    def _plan(self, question: str, snapshot: Snapshot | None, context: Sequence[Passage] | None,
              reuse_cache: bool, may_decline: bool = True, excerpt: str = "") -> tuple[str, list[int], int, int]:
        """Decide the route; return (route, all prompt ids, count of leading ids the snapshot holds, count of
        leading ids of the system turn). With a snapshot, ``context`` holds the newer passages that follow the
        document (cache+retrieval). Over a document alone, a question that may be declined is asked with the
        document's sentences closest to it quoted ahead of it (``focus_tokens``), when they fit the question
        budget."""
        if snapshot is not None:
            self._check(snapshot)
            if self.focus_tokens and not context and not excerpt and may_decline:
                quote = focus(question, document_body(snapshot), self.focus_tokens, self._count_tokens)
                if quote:
                    planned = self._plan(question, snapshot, None, reuse_cache, excerpt=quote)
                    if len(planned[1]) - planned[3] <= self.question_budget_tokens:
                        return planned
            prompt = self.prompts.tokenize(snapshot.system_prompt, question, snapshot.prefix_token_ids,
                                           updates=context or (), may_decline=may_decline, excerpt=excerpt)
            if reuse_cache:
                return ("cache+retrieval" if context else "cache"), prompt.ids, prompt.prefix_len, prompt.prefix_len
            return "full", prompt.ids, 0, prompt.prefix_len
        if context is not None:
            layout = self.prompts.passage_layout(context, question)
            prompt = self.prompts.tokenize(passages_system(context, question), question, layout.ids,
                                           may_decline=may_decline, excerpt=excerpt, joined=True)
            return "retrieval", prompt.ids, 0, prompt.prefix_len
        prompt = self.prompts.tokenize(QUESTION_ONLY_SYSTEM, question, may_decline=may_decline)
        return "question-only", prompt.ids, 0, prompt.prefix_len

    def prompt_ids(self, question: str, snapshot: Snapshot | None = None,
                   context: Sequence[Passage] | None = None) -> list[int]:
        """The whole prompt's token ids as its route builds them: for a peer engine to prefill the same."""
        return self._plan(question, snapshot, context, reuse_cache=True)[1]

    def _count_tokens(self, text: str) -> int:
        return len(self.prompts.encode(text))

    def _check_room(self, route: str, ids: list[int], reused: int, budget: int) -> None:
        if budget < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if len(ids) + budget > self.max_context_tokens:
            raise PromptError(f"prompt of {len(ids)} tokens + {budget} new tokens exceeds the context of "
                              f"{self.max_context_tokens} tokens", code="context_exceeded")
        if len(ids) - reused > self.question_budget_tokens and route == "cache":
            raise PromptError(f"question is {len(ids) - reused} tokens; the limit is {self.question_budget_tokens}")

    @torch.inference_mode()
    def suffix_logits(self, question: str, snapshot: Snapshot, reuse_cache: bool = True,
                      updates: Sequence[Passage] | None = None) -> torch.Tensor:
        """Logits at the positions after the document (newer passages and question), with or without the
        snapshot: the exactness check."""
        _, ids, reused, prefix_len = self._plan(question, snapshot, updates, reuse_cache)
        if self.fast is not None:
            return self.fast.logits(self._fast_prefix(ids, reused, prefix_len, snapshot)[0], ids[prefix_len:])
        if reused and self.prefix_decoder is not None:
            suffix = ids[reused:]
            cache = self.prefix_decoder.start(snapshot.keys, snapshot.values, 1, len(suffix))
            return self.prefix_decoder.step(cache, [suffix], all_positions=True)[0]
        cache = self._cache_from(snapshot) if reused else DynamicCache(config=self.config)
        logits = self.model(input_ids=torch.tensor([ids[reused:]]), cache=cache, use_cache=True).logits[0]
        return logits[prefix_len - reused:]

    def _fast_prefix(self, ids: list[int], reused: int, prefix_len: int, snapshot: Snapshot | None,
                     passages: Sequence[Passage] | None = None, question: str = "") -> tuple[object, int]:
        """The int8 engine's prefix for a prompt and how many of its tokens were reused: the snapshot's
        tensors (cache route); on the retrieval route the passages' reused states where ``passage_states``
        is on; else the system turn computed now in the same blocks (full
        route: hence bitwise the cache route's numbers). Kept, so the relevance check after the answer
        prefills only its own question."""
        if reused:
            return (snapshot.keys, snapshot.values), reused
        if passages and snapshot is None and self.passage_states is not None:
            return self.passage_states.compose(self.prompts.passage_layout(passages, question))
        return self.fast.prefill_prefix(ids[:prefix_len]), 0

    @torch.inference_mode()
    def _greedy_rows(self, suffixes: Sequence[list[int]], snapshot: Snapshot, budget: int,
                     eos: frozenset[int] | None = None) -> Iterator[dict[int, int]]:
        """Decode every row against the shared snapshot together; yield {row: token} of the rows still
        running at each step. A row stops after an EOS token or ``budget`` other tokens."""
        eos = self.eos_ids if eos is None else eos
        if self.fast is not None:
            for step in self.fast.steps((snapshot.keys, snapshot.values), suffixes, budget, eos):
                yield {row: token for row, (token, _) in step.items()}
            return
        cache = self.prefix_decoder.start(snapshot.keys, snapshot.values, len(suffixes), max(map(len, suffixes)) + budget)
        running = list(range(len(suffixes)))
        feeds = [list(suffix) for suffix in suffixes]
        produced = [0] * len(suffixes)
        while running:
            tokens = self.prefix_decoder.step(cache, feeds).argmax(-1).tolist()
            yield dict(zip(running, tokens))
            keep = []
            for position, (row, token) in enumerate(zip(running, tokens)):
                produced[row] += 1
                if token not in eos and produced[row] < budget:
                    keep.append(position)
            if keep and len(keep) < len(running):
                cache.keep_rows(keep)
            running = [running[position] for position in keep]
            feeds = [[tokens[position]] for position in keep]

    @torch.inference_mode()
    def _greedy(self, ids: list[int], reused: int, snapshot: Snapshot | None, budget: int,
                eos: frozenset[int] | None = None, prefix=None) -> Iterator[int]:
        """Greedy tokens for one prompt until EOS (yielded; ``eos`` defaults to the model's) or ``budget``
        tokens; ``prefix`` is the int8 engine's (``_fast_prefix``)."""
        eos = self.eos_ids if eos is None else eos
        if self.fast is not None:
            start = prefix[0][0].shape[1]
            lookup = ids if self.prompt_lookup else None
            for step in self.fast.steps(prefix, [ids[start:]], budget, eos, lookup=lookup):
                yield step[0][0]
            return
        if reused and self.prefix_decoder is not None:
            for step in self._greedy_rows([ids[reused:]], snapshot, budget, eos):
                yield step[0]
            return
        cache = self._cache_from(snapshot) if reused else DynamicCache(config=self.config)
        feed = ids[reused:]
        for _ in range(budget):
            token = int(self.model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True).logits[0, -1].argmax())
            yield token
            if token in eos:
                return
            feed = [token]

    def stream(self, question: str, snapshot: Snapshot | None = None, context: Sequence[Passage] | None = None,
               max_new_tokens: int | None = None, reuse_cache: bool = True) -> Iterator[str | Answer]:
        """Yield text pieces as tokens are decoded, then the final ``Answer``. Text that may still turn out to
        be the decline sentence is held back: a decline that the document alone (after newer passages) or the
        relevance check overrules is never shown."""
        started = time.perf_counter()
        stages = Stages(started)
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        route, ids, reused, prefix_len = self._plan(question, snapshot, context, reuse_cache)
        self._check_room(route, ids, reused, budget)
        prefix = None
        if self.fast is not None:
            prefix, reused = self._fast_prefix(ids, reused, prefix_len, snapshot, context, question)
        stages.lap("prefix")
        decoded = Decoded(started)
        yield from self._decode(decoded, ids, reused, snapshot, budget, prefix, hold=wording(question).declined)
        answer = decoded.answer(self.tokenizer, snapshot, context, question, route, len(ids), reused,
                                self.disabled_rules)
        stages.lap("answer")
        if snapshot is not None and context and answer.decline_reason == "model_declined" and self._applies(
                answer, "reask_document_alone"):
            # Newer passages are there to override a fact of the document; when the model finds no answer with
            # them, they may have drawn it off one the document holds ("where does yfctl put its diagnostics
            # bundle?" declined next to a release note on `yfctl backup restore`). The document alone is asked,
            # over the same prefix; the decline stays unseen, as below.
            context = None
            route, ids, reused, _ = self._plan(question, snapshot, None, reuse_cache)
            decoded = Decoded(started)
            yield from self._decode(decoded, ids, reused, snapshot, budget, prefix, hold=wording(question).declined)
            answer = decoded.answer(self.tokenizer, snapshot, None, question, route, len(ids), reused,
                                    self.disabled_rules)
            answer.rules_fired = ("reask_document_alone", *answer.rules_fired)
            stages.lap("reask")
        again = route != "question-only" and self._check_relevance(answer, question, snapshot, context, reused,
                                                                    prefix)
        stages.lap("relevance")
        if again:
            for item in self._answer_again(answer, question, snapshot, context, reuse_cache, budget, prefix, started):
                if isinstance(item, Answer):
                    answer = item
                else:
                    yield item
            stages.lap("reask")
        else:
            yield from decoded.rest(self.tokenizer)
            stages.lap("answer")
        answer.total_s = time.perf_counter() - started
        answer.stages_ms, answer.stage_laps = stages.ms, stages.laps
        yield answer

    def _answer_again(self, declined: Answer, question: str, snapshot: Snapshot | None,
                      context: Sequence[Passage] | None, reuse_cache: bool, budget: int, prefix,
                      started: float) -> Iterator[str | Answer]:
        """Ask a declined question again over the same prefix, as ``model.relevance.reask_<language>`` says:
        with the part of the text closest to the question quoted ahead of it, or without the option to decline.
        Yields the new text as it is decoded, then the new answer, which keeps the decline's relevance."""
        if self.relevance_check.reask(language(question)) == "excerpt":
            route, ids, reused = self._excerpt_plan(question, snapshot, context, reuse_cache)
        else:
            route, ids, reused, _ = self._plan(question, snapshot, context, reuse_cache, may_decline=False)
        self._check_room(route, ids, reused, budget)
        again = Decoded(started)
        yield from self._decode(again, ids, reused, snapshot, budget, prefix)
        # the record counts the first attempt's prefix (its passage states), which served again
        answer = again.answer(self.tokenizer, snapshot, context, question, route, len(ids),
                              max(reused, declined.reused_tokens), self.disabled_rules)
        answer.relevance, answer.reasked = declined.relevance, True
        answer.rules_fired = (*declined.rules_fired, *answer.rules_fired)
        yield answer

    def _excerpt_plan(self, question: str, snapshot: Snapshot | None, context: Sequence[Passage] | None,
                      reuse_cache: bool) -> tuple[str, list[int], int]:
        """The plan of a question with the closest part of its text quoted ahead of it, cut (at a token) to
        what the question budget leaves, as the quote is prefilled per request like the question; a question
        that leaves no room is asked as before."""
        excerpt = closest_part(question, snapshot, context)
        while excerpt:
            route, ids, reused, prefix_len = self._plan(question, snapshot, context, reuse_cache, excerpt=excerpt)
            over = len(ids) - prefix_len - self.question_budget_tokens
            if over <= 0:
                return route, ids, reused
            tokens = self.prompts.encode(excerpt)
            keep = len(tokens) - over - 4
            excerpt = self.tokenizer.decode(tokens[:keep]).rstrip("\ufffd").rstrip() + " …" if keep >= 16 else ""
        route, ids, reused, _ = self._plan(question, snapshot, context, reuse_cache)
        return route, ids, reused

    def _decode(self, decoded: "Decoded", ids: list[int], reused: int, snapshot: Snapshot | None, budget: int,
                prefix, hold: str = "") -> Iterator[str]:
        """Greedy-decode into ``decoded``, yielding new text as it is known, except text that is still a start
        of ``hold`` (and a half-decoded multi-byte character)."""
        for token in self._greedy(ids, reused, snapshot, budget, prefix=prefix):
            decoded.ttft_s = decoded.ttft_s or time.perf_counter() - decoded.started
            if token in self.eos_ids:
                decoded.finish = "eos"
                return
            decoded.tokens.append(token)
            text = self.tokenizer.decode(decoded.tokens, skip_special_tokens=True)
            if text.endswith("\ufffd") or (hold and hold.startswith(text.strip())):
                continue
            if len(text) > len(decoded.emitted):
                yield text[len(decoded.emitted):]
            decoded.emitted = text

    def _check_relevance(self, answer: Answer, question: str, snapshot: Snapshot | None,
                         context: Sequence[Passage] | None, reused: int, prefix) -> bool:
        """The relevance check of an answer just decoded: an answer below the decline threshold is declined
        (``not_relevant``); a decline by the model at or above the re-ask threshold is to be asked again without
        the option to decline (returns True). A small model asked what its text does not say tends to answer
        with the nearest fact; asked in Chinese, it often declines what its text does say."""
        if self.relevance_check is None:
            return False
        decline_below, reask_from = self.relevance_check.thresholds(language(question))
        if not (answer.answered and decline_below > 0 or answer.decline_reason == "model_declined" and reask_from <= 1):
            return False
        given = answer.text if answer.answered else ""  # its own words tell a near-miss question apart better
        answer.relevance = self.relevance(question, snapshot, context, reused, prefix, given)
        if answer.answered and answer.relevance < decline_below and self._applies(answer, "not_in_documents"):
            answer.answered, answer.not_relevant = False, True
        return (not answer.answered and not answer.not_relevant and answer.relevance >= reask_from
                and self._applies(answer, "reask_relevant_decline"))

    def _applies(self, answer: Answer, rule: str) -> bool:
        """Record that ``rule`` holds for ``answer``; whether it is switched on (``rules.disabled``)."""
        answer.rules_fired = (*answer.rules_fired, rule)
        return rule not in self.disabled_rules

    def answer(self, question: str, snapshot: Snapshot | None = None, context: Sequence[Passage] | None = None,
               max_new_tokens: int | None = None, reuse_cache: bool = True) -> Answer:
        """Answer in one call; see ``stream`` for the routes."""
        for item in self.stream(question, snapshot, context, max_new_tokens, reuse_cache):
            if isinstance(item, Answer):
                return item
        raise AssertionError("stream ended without an answer")

    def timed_answer(self, question: str, snapshot: Snapshot | None = None, tokens: int = 40,
                     reuse_cache: bool = True) -> tuple[float, float, list[int], float]:
        """For benchmarks: exactly ``tokens`` greedy tokens (EOS does not stop them, so every run decodes the
        same count) on the route ``answer`` would take; returns (ttft_s, total_s, token ids, end_s), end_s being
        when the answer's own end (its first EOS token) came, or total_s when it did not come."""
        started = time.perf_counter()
        route, ids, reused, prefix_len = self._plan(question, snapshot, None, reuse_cache)
        self._check_room(route, ids, reused, tokens)
        prefix = self._fast_prefix(ids, reused, prefix_len, snapshot)[0] if self.fast is not None else None
        generated: list[int] = []
        ttft = end = 0.0
        for token in self._greedy(ids, reused, snapshot, tokens, eos=frozenset(), prefix=prefix):
            ttft = ttft or time.perf_counter() - started
            end = end or (time.perf_counter() - started if token in self.eos_ids else 0.0)
            generated.append(token)
        total = time.perf_counter() - started
        return ttft, total, generated, end or total

    def answer_batch(self, questions: Sequence[str], snapshot: Snapshot,
                     max_new_tokens: int | None = None) -> list[Answer]:
        """Answer several questions about one snapshot, decoded together: the prefix is read once per step
        for all of them. Each answer is token-identical to ``answer`` on its own; its ttft_s and total_s
        are measured from the call to that row's first and last token."""
        started = time.perf_counter()
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        plans = [self._plan(question, snapshot, None, True) for question in questions]
        for route, ids, reused, _ in plans:
            self._check_room(route, ids, reused, budget)
        if (self.fast is None and self.prefix_decoder is None) or not plans:
            return [self.answer(question, snapshot=snapshot, max_new_tokens=budget) for question in questions]
        generated: list[list[int]] = [[] for _ in plans]
        ttft = [0.0] * len(plans)
        finished = [0.0] * len(plans)
        finish = ["length"] * len(plans)
        for step in self._greedy_rows([ids[reused:] for _, ids, reused, _ in plans], snapshot, budget):
            now = time.perf_counter() - started
            for row, token in step.items():
                ttft[row] = ttft[row] or now
                finished[row] = now
                if token in self.eos_ids:
                    finish[row] = "eos"
                else:
                    generated[row].append(token)
        answers = [grounded_answer(self.tokenizer.decode(tokens, skip_special_tokens=True).strip(),
                                   snapshot.system_prompt, questions[row], self.disabled_rules, route="cache",
                                   prompt_tokens=len(ids), reused_tokens=reused, ttft_s=ttft[row],
                                   total_s=finished[row], finish_reason=finish[row], token_ids=tokens,
                                   snapshot_key=str(snapshot.key))
                   for row, ((_, ids, reused, _), tokens) in enumerate(zip(plans, generated))]
        if self.relevance_check is None:
            return answers
        prefix = (snapshot.keys, snapshot.values) if self.fast is not None else None
        for row, (answer, question) in enumerate(zip(answers, questions)):
            if self._check_relevance(answer, question, snapshot, None, len(snapshot.prefix_token_ids), prefix):
                *_, answers[row] = self._answer_again(answer, question, snapshot, None, True, budget, prefix, started)
            answers[row].total_s = time.perf_counter() - started
        return answers

    @torch.inference_mode()
    def relevance(self, question: str, snapshot: Snapshot | None = None, context: Sequence[Passage] | None = None,
                  reused: int = 0, prefix=None, answer: str = "") -> float:
        """The model's probability that the document (``snapshot``) or passages (``context``; with a snapshot:
        newer passages after it) answer ``question`` (with ``answer``: give that answer): it is asked so, after
        the same system turn, and its "yes" and "no" tokens are compared. The prompt shares the answer's prefix
        (``reused`` snapshot ids, or the int8 engine's ``prefix``): only the check's own tokens are prefilled."""
        if snapshot is not None:
            prompt = self.prompts.tokenize_relevance(snapshot.system_prompt, question, snapshot.prefix_token_ids,
                                                     updates=context or (), answer=answer)
        else:
            prompt = self.prompts.tokenize_relevance(passages_system(context or (), question), question,
                                                     self.prompts.passage_layout(context or (), question).ids,
                                                     joined=True, answer=answer)
        ids = prompt.ids
        if self.fast is not None:
            if prefix is None:
                prefix = self.fast.prefill_prefix(ids[:prompt.prefix_len])
            logits = self.fast.logits(prefix, ids[prefix[0][0].shape[1]:], last_only=True)[-1]
        elif reused and self.prefix_decoder is not None:
            cache = self.prefix_decoder.start(snapshot.keys, snapshot.values, 1, len(ids) - reused)
            logits = self.prefix_decoder.step(cache, [ids[reused:]])[0]
        else:
            cache = self._cache_from(snapshot) if reused else DynamicCache(config=self.config)
            logits = self.model(input_ids=torch.tensor([ids[reused:]]), cache=cache, use_cache=True).logits[0, -1]
        words = wording(question)
        yes, no = (self.prompts.encode(word)[0] for word in (words.yes, words.no))
        return float(torch.softmax(logits[[yes, no]].float(), dim=0)[0])
