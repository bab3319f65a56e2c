"""Which signal tells a wrong answer from a right one? A trial in one process, on a public dataset's half.

Every answerable and near-miss question of the half is asked on the cache route (its article's snapshot, the
engine of ``config.yaml``; ``--focus-tokens N`` quotes the document's closest sentences ahead of the question;
``--contrast ALPHA`` decodes by context-aware decoding instead of greedily: each token maximises
(1 + ALPHA) log p(token | document, question) - ALPHA log p(token | question alone), among the tokens at least a
tenth as likely as the best one with the document, which favours what the document says over what the model
would say without it), and each answer the model gives is rated three ways, none of which the engine acts on here:

- ``answer_check``: the engine's answer check (rule ``not_in_documents``), the model asked over the same
  document whether the text gives this answer to this question (P("yes"));
- ``quote_check``: the model asked in a short prompt of its own whether the sentence the answer would be
  quoted from (``answering.quotes``) answers exactly this question (P("yes")), the document left out;
- ``decline_logprob``: the log-probability of the decline sentence as the reply, after the same prompt.

Usage: python bench/answer_signals.py --dataset squad2-dev --split calibration [--focus-tokens 128 | --contrast 0.5]
Writes bench/results/signals-<dataset>-<split>-<time>.json (every answer and rating) and prints, per signal
and threshold, what declining below it would do: right answers lost, near-miss questions caught, wrong
answers to answerable questions stopped (bench/README "Signals for declining").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cagflow.answering.prompt import WORDINGS, wording
from cagflow.answering.quotes import quote
from cagflow.bench import scoring
from cagflow.bench.datasets import load_dataset
from cagflow.config import load_config
from cagflow.documents.parsing import parse_file
from cagflow.engine.answers import Decoded, document_body
from cagflow.engine.engine import Engine
from cagflow.engine.weights_file import round_up

QUOTE_CHECK = {"en": 'Sentence: "{sentence}"\nQuestion: "{question}"\nDoes the sentence answer exactly this question? '
                     "Reply Yes or No.",
               "zh": "句子：“{sentence}”\n问题：“{question}”\n这个句子是否正好回答了这个问题？只回答“是”或“否”。"}
GRIDS = {"answer_check": [0.3, 0.4, 0.5, 0.55, 0.6, 0.66, 0.7, 0.8],
         "quote_check": [0.3, 0.4, 0.5, 0.55, 0.6, 0.66, 0.7, 0.8],
         "decline_logprob": [-1.5, -2.0, -2.5, -3.0]}  # declines where the decline sentence is at least this likely


def _yes(engine: Engine, logits: torch.Tensor, language: str) -> float:
    words = WORDINGS[language]
    yes, no = (engine.prompts.encode(word)[0] for word in (words.yes, words.no))
    return float(torch.softmax(logits[[yes, no]].float(), dim=0)[0])


@torch.inference_mode()
def rate(engine: Engine, question: str, language: str, snapshot, answer: str) -> dict:
    """The three ratings of one answer (module docstring)."""
    ids = engine.prompt_ids(question, snapshot)
    reused = len(snapshot.prefix_token_ids)  # the cache route prefills only what follows the snapshot
    prefix = (snapshot.keys, snapshot.values)
    declined = engine.prompts.encode(wording(question).declined)
    suffix = ids[reused:]
    logits = engine.fast.logits(prefix, suffix + declined).float().log_softmax(-1)
    decline_logprob = sum(float(logits[len(suffix) - 1 + at, token]) for at, token in enumerate(declined))
    sentence = quote(answer, question, document_body(snapshot)) or ""
    message = QUOTE_CHECK[language].format(sentence=sentence, question=question)
    short = engine.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
    short_logits = engine.fast.logits(engine.fast.prefill_prefix(short[:-1]), short[-1:], last_only=True)[-1]
    return {"answer_check": engine.relevance(question, snapshot, None, reused, prefix, answer),
            "quote_check": _yes(engine, short_logits, language), "quote": sentence,
            "decline_logprob": decline_logprob}


@dataclass
class _Row:
    """One of the two prompts context-aware decoding runs side by side: its prefix, suffix K/V, length so far
    and the logits of its next token."""

    prefix: object
    keys: list
    values: list
    length: int
    logits: torch.Tensor


@torch.inference_mode()
def contrast_answer(engine: Engine, question: str, snapshot, alpha: float, budget: int = 64):
    """The answer decoded with context-aware decoding (module docstring), graded as the engine grades one.
    ``FastLM.steps`` picks its own (greedy) tokens, so the two prompts are stepped here, block by block."""
    fast = engine.fast
    decoded = Decoded(time.perf_counter())
    reused = len(snapshot.prefix_token_ids)
    with_document = engine.prompt_ids(question, snapshot)[reused:]
    rows = []
    for prefix, suffix in (((snapshot.keys, snapshot.values), with_document), (None, engine.prompt_ids(question))):
        keys, values = fast._new_suffix(1, round_up(len(suffix) + budget, 16))
        hidden = fast._block(torch.tensor([suffix]), prefix, keys, values, torch.zeros(1, dtype=torch.long))
        rows.append(_Row(prefix, keys, values, len(suffix), fast._head(hidden[0, -1:])[0]))
    while len(decoded.tokens) < budget:
        document, alone = (row.logits.float().log_softmax(-1) for row in rows)
        score = (1 + alpha) * document - alpha * alone
        score[document < document.max() + math.log(0.1)] = -math.inf
        token = int(score.argmax())
        decoded.ttft_s = decoded.ttft_s or time.perf_counter() - decoded.started
        if token in engine.eos_ids:
            decoded.finish = "eos"
            break
        decoded.tokens.append(token)
        for row in rows:
            hidden = fast._block(torch.tensor([[token]]), row.prefix, row.keys, row.values, torch.tensor([row.length]))
            row.length += 1
            row.logits = fast._head(hidden[:, 0])[0]
    return decoded.answer(engine.tokenizer, snapshot, None, question, "cache", reused + len(with_document), reused,
                          engine.disabled_rules)


def sweep(records: list[dict]) -> dict:
    """Per signal and threshold: of the answered records, the right ones it declines, the near-miss ones it
    catches, the wrong answerable ones it stops."""
    answered = [record for record in records if record["answered"]]
    table: dict = {}
    for signal, grid in GRIDS.items():
        table[signal] = {}
        for threshold in grid:
            declines = [record for record in answered if (record[signal] >= threshold if signal == "decline_logprob"
                                                          else record[signal] < threshold)]
            table[signal][str(threshold)] = {
                "right_lost": sum(record["kind"] == "answerable" and record["right"] for record in declines),
                "near_miss_caught": sum(record["kind"] == "near_miss" for record in declines),
                "wrong_stopped": sum(record["kind"] == "answerable" and not record["right"] for record in declines)}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True, help="a dataset under bench/datasets or a path")
    parser.add_argument("--split", choices=("calibration", "report"), required=True)
    parser.add_argument("--focus-tokens", type=int, default=0)
    parser.add_argument("--contrast", type=float, default=0.0, metavar="ALPHA")
    args = parser.parse_args()
    dataset = load_dataset(args.dataset)
    engine = Engine.from_config(load_config().model)
    engine.focus_tokens = args.focus_tokens
    entries = {entry.doc_id: entry for entry in dataset.corpus.documents}
    snapshots: dict = {}
    records = []
    for question in dataset.questions:
        if question.split != args.split or question.kind not in ("answerable", "near_miss"):
            continue
        if question.article not in snapshots:
            entry = entries[question.article]
            parts = engine.split(entry.doc_id, entry.version, parse_file(dataset.corpus.file(entry), entry.title))
            snapshots[question.article] = engine.precompute(parts[0])  # the public articles fit one part
        snapshot = snapshots[question.article]
        answer = (contrast_answer(engine, question.question, snapshot, args.contrast) if args.contrast
                  else engine.answer(question.question, snapshot, max_new_tokens=64))
        record = {"id": question.id, "kind": question.kind, "question": question.question,
                  "answers": list(question.answers), "answer": answer.text, "answered": answer.answered,
                  "decline_reason": answer.decline_reason, "ttft_s": answer.ttft_s,
                  "right": answer.answered and scoring.contains_gold(question.answers, answer.text, question.language),
                  "f1": scoring.f1(question.answers, answer.text, question.language) if answer.answered else 0.0}
        if answer.answered:
            record.update(rate(engine, question.question, question.language, snapshot, answer.text))
        records.append(record)
        print(f"{question.id} {question.kind:<10} {'R' if record['right'] else '-'} {answer.text[:90]!r}", flush=True)
    answerable = [record for record in records if record["kind"] == "answerable"]
    near_miss = [record for record in records if record["kind"] == "near_miss"]
    summary = {"answerable_right": sum(record["right"] for record in answerable), "answerable": len(answerable),
               "near_miss_declined": sum(not record["answered"] for record in near_miss), "near_miss": len(near_miss),
               "f1": statistics.fmean(record["f1"] for record in answerable) if answerable else None,
               "p50_ttft_s": statistics.median(record["ttft_s"] for record in records) if records else None}
    result = {"dataset": dataset.name, "split": args.split, "focus_tokens": args.focus_tokens,
              "contrast": args.contrast, "model": engine.fingerprint, "summary": summary, "sweep": sweep(records),
              "records": records}
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(__file__).parent / "results" / f"signals-{dataset.name}-{args.split}-{stamp}.json"
    out.write_text(json.dumps(result, ensure_ascii=False, indent=1))
    print(f"\n{dataset.name} {args.split}, focus {args.focus_tokens}, contrast {args.contrast}: answerable right "
          f"{summary['answerable_right']}/"
          f"{summary['answerable']}, near-miss declined {summary['near_miss_declined']}/{summary['near_miss']}, "
          f"TTFT p50 {summary['p50_ttft_s']:.2f} s")
    for signal, rows in result["sweep"].items():
        for threshold, cell in rows.items():
            print(f"  {signal:<16} {threshold:>5}: right lost {cell['right_lost']:>2}, near-miss caught "
                  f"{cell['near_miss_caught']:>2}, wrong stopped {cell['wrong_stopped']:>2}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
