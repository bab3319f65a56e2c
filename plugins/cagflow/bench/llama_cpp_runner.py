"""Runs inside the llama.cpp peer's own virtual environment (llama-cpp-python, no torch): answers the same
prompts from the same GGUF file with a saved prompt state, the way a CPU user would cache a document
with llama.cpp, and prints the timings as JSON. Reads its job, JSON, on stdin; imports nothing of CAGFlow.

For each case: the document prefix is evaluated once and its state saved (``llama_state_get_data``) into
the job's ``state_dir``, where a later job finds it instead of evaluating the prefix again (so the caller
can alternate single runs with its own engine); then, in one timed run, the state is restored
(``llama_state_set_data``), the question evaluated (time to first token) and greedy tokens decoded one at
a time to the answer length, ignoring end-of-sequence so every run decodes the same count; the time to the
answer's own end (its first stop token) is noted on the way.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path


def _greedy_token(llm, n_vocab: int) -> int:
    import numpy as np

    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
    return int(logits.argmax())


def _prefix_state(llm, llama_cpp, case: dict, state_dir: Path) -> tuple[bytes, float | None]:
    """The state after the case's prefix, and the seconds its evaluation took (None: read from ``state_dir``)."""
    saved = state_dir / f"{case['name']}.state"
    if saved.exists():
        return saved.read_bytes(), None
    llm.reset()
    started = time.perf_counter()
    if case["prefix_ids"]:
        llm.eval(case["prefix_ids"])
    prefill_s = time.perf_counter() - started
    size = llama_cpp.llama_state_get_size(llm._ctx.ctx)
    buffer = (ctypes.c_uint8 * int(size))()
    state = bytes(buffer[:int(llama_cpp.llama_state_get_data(llm._ctx.ctx, buffer, size))])
    saved.write_bytes(state)
    return state, prefill_s


def _run_case(llm, llama_cpp, case: dict, job: dict) -> dict:
    n_vocab, new_tokens, stop_ids = llm.n_vocab(), job["new_tokens"], frozenset(job["stop_ids"])
    state, prefill_s = _prefix_state(llm, llama_cpp, case, Path(job["state_dir"]))
    buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    state_bytes, prefix_tokens = len(state), len(case["prefix_ids"])
    started = time.perf_counter()
    if llama_cpp.llama_state_set_data(llm._ctx.ctx, buffer, state_bytes) != state_bytes:
        raise RuntimeError("llama_state_set_data failed")
    llm.n_tokens = prefix_tokens
    restored = time.perf_counter()
    llm.eval(case["question_ids"])
    tokens = [_greedy_token(llm, n_vocab)]
    first = time.perf_counter()
    end = first if tokens[0] in stop_ids else 0.0
    while len(tokens) < new_tokens:
        llm.eval([tokens[-1]])
        tokens.append(_greedy_token(llm, n_vocab))
        end = end or (time.perf_counter() if tokens[-1] in stop_ids else 0.0)
    done = time.perf_counter()
    return {"name": case["name"], "prefix_tokens": prefix_tokens, "prefill_s": prefill_s, "state_bytes": state_bytes,
            "tokens": tokens, "restore_s": restored - started, "ttft_s": first - restored,
            "decode_tok_s": (new_tokens - 1) / (done - first), "answer_s": done - started,
            "end_s": (end or done) - started}


def main() -> int:
    job = json.load(sys.stdin)
    import llama_cpp

    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_batch=512, n_threads=job["threads"],
                          n_threads_batch=job["threads"], logits_all=False, verbose=False)
    llm.eval(job["cases"][0]["question_ids"][:8])  # untimed: the mapped weights' pages are touched once, as in a
    llm.reset()                                     # server that has answered before
    results = [_run_case(llm, llama_cpp, case, job) for case in job["cases"]]
    json.dump({"llama_cpp_version": llama_cpp.__version__, "cases": results}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
