"""Runs inside the llama.cpp peer's own virtual environment (llama-cpp-python, no torch): answers the same
prompts from the same GGUF file with a saved prompt state, the way a CPU user would cache a document
with llama.cpp, and prints the timings as JSON. Reads its job, JSON, on stdin; imports nothing of CAGFlow.

For each case: the document prefix is evaluated once and its state saved (``llama_state_get_data``);
then, per run, the state is restored (``llama_state_set_data``), the question evaluated (time to first
token) and greedy tokens decoded one at a time to the answer length, ignoring end-of-sequence so every
run decodes the same count.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time


def _greedy_token(llm, n_vocab: int) -> int:
    import numpy as np

    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
    return int(logits.argmax())


def _run_case(llm, llama_cpp, case: dict, new_tokens: int, runs: int) -> dict:
    n_vocab = llm.n_vocab()
    llm.reset()
    started = time.perf_counter()
    if case["prefix_ids"]:
        llm.eval(case["prefix_ids"])
    prefill_s = time.perf_counter() - started
    size = llama_cpp.llama_state_get_size(llm._ctx.ctx)
    buffer = (ctypes.c_uint8 * int(size))()
    state_bytes = int(llama_cpp.llama_state_get_data(llm._ctx.ctx, buffer, size))
    prefix_tokens = llm.n_tokens
    timings = []
    tokens: list[int] = []
    for _ in range(runs):
        started = time.perf_counter()
        if llama_cpp.llama_state_set_data(llm._ctx.ctx, buffer, state_bytes) != state_bytes:
            raise RuntimeError("llama_state_set_data failed")
        llm.n_tokens = prefix_tokens
        restored = time.perf_counter()
        llm.eval(case["question_ids"])
        tokens = [_greedy_token(llm, n_vocab)]
        first = time.perf_counter()
        while len(tokens) < new_tokens:
            llm.eval([tokens[-1]])
            tokens.append(_greedy_token(llm, n_vocab))
        done = time.perf_counter()
        timings.append({"restore_s": restored - started, "ttft_s": first - restored,
                        "decode_tok_s": (new_tokens - 1) / (done - first), "answer_s": done - started})
    median = {name: statistics.median(run[name] for run in timings) for name in timings[0]}
    return {"name": case["name"], "prefix_tokens": prefix_tokens, "prefill_s": prefill_s, "state_bytes": state_bytes,
            "tokens": tokens, **median}


def main() -> int:
    job = json.load(sys.stdin)
    import llama_cpp

    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_batch=512, n_threads=job["threads"],
                          n_threads_batch=job["threads"], logits_all=False, verbose=False)
    results = [_run_case(llm, llama_cpp, case, job["new_tokens"], job["runs"]) for case in job["cases"]]
    json.dump({"llama_cpp_version": llama_cpp.__version__, "cases": results}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
