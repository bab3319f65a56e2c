"""`cagflow bench engine`'s serving workload on the tiny model: every request is accounted for once, and
a skewed workload is mostly served without recomputing."""

from __future__ import annotations

from cagflow.bench import engine as engine_bench
from cagflow.config import load_config


def test_serving_workload_counts_every_request_once(tiny_engine, corpus_manifest_path):
    part = engine_bench.synthetic_part(tiny_engine, corpus_manifest_path.parent / "fixed", 300)
    report = engine_bench.measure_serving(tiny_engine, tiny_engine.precompute(part), load_config(environ={}), rounds=3)
    assert report["requests"] == 3 * engine_bench.BATCH_SIZES[-1]
    assert report["computed"] + report["merged"] + report["answer-cache"] == report["requests"]
    assert 1 <= report["computed"] <= report["distinct_questions"]  # each question is computed at most once
    assert report["answer-cache"] > 0 and report["merge_rate"] + report["answer_cache_hit_rate"] > 0.5


def test_engine_measurements_on_the_tiny_model(tiny_engine, corpus_manifest_path, monkeypatch, capsys):
    """Every figure of the table is measured (short documents, one run), and the table prints."""
    monkeypatch.setattr(engine_bench, "BATCH_DOCUMENT_TOKENS", 600)
    monkeypatch.setattr(engine_bench, "BATCH_SIZES", (1, 2))
    measured = engine_bench.measure(tiny_engine, corpus_manifest_path.parent / "fixed", runs=1,
                                    document_tokens=(300, 600))
    snapshots, passages = measured.pop("snapshots"), measured.pop("passages")
    assert sorted(snapshots) == [300, 600] and 500 <= measured["retrieval"]["prompt_tokens"] <= 900
    config = tiny_engine.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # K and V, bf16
    for row, tokens in zip(measured["documents"], (300, 600)):
        assert tokens - 40 <= row["document_tokens"] <= tokens and row["snapshot_bytes_per_token"] == per_token
        assert 0 < row["hit_ttft_s"] < row["hit_answer_s"] and row["hit_decode_tok_s"] > 0
        assert row["hit_answer_one_token_a_pass_s"] > row["hit_ttft_s"]
        assert row["hit_ttft_s"] <= row["hit_end_s"] <= row["hit_answer_s"] and 1 <= row["hit_end_tokens"] <= 40
        assert row["hit_ttft_s"] <= row["hit_end_one_token_a_pass_s"] <= row["hit_answer_one_token_a_pass_s"]
        assert row["bytes"] > per_token * row["document_tokens"] and row["load_mb_s"] > 0
    assert [b["questions"] for b in measured["batches"]] == [1, 2]
    cases = engine_bench._peer_cases(tiny_engine, snapshots, passages)
    assert [case["name"] for case in cases] == ["question-only", "retrieval", "300", "600"]
    retrieval = cases[1]  # the retrieval route's whole prompt, none of it restored
    assert retrieval["prefix_ids"] == [] and len(retrieval["question_ids"]) == measured["retrieval"]["prompt_tokens"]
    ours = engine_bench._ours_once(tiny_engine, snapshots, passages)
    assert set(ours) == {case["name"] for case in cases} and ours["retrieval"]["ttft_s"] > 0
    assert all(ours[name]["end_s"] <= ours[name]["answer_s"] for name in ("question-only", "300", "600"))
    peer = {"llama_cpp_version": "x", "gguf": "m.gguf", "ours": ours, "cases": [
        {"name": case["name"], "restore_s": 0.01, "ttft_s": 0.1, "decode_tok_s": 50.0, "answer_s": 1.0,
         "end_s": 0.5, "state_bytes": 10**6} for case in cases]}
    serving = {"requests": 1, "burst": 1, "distinct_questions": 1, "computed": 1, "merged": 0, "answer-cache": 0,
               "merge_rate": 0.0, "answer_cache_hit_rate": 0.0, "answers_per_s": 1.0}
    engine_bench.print_table({"model": "tiny", "recipe": tiny_engine.recipe, "threads": 1, "runs": 1, **measured,
                              "peer": peer, "serving": serving})
    table = capsys.readouterr().out
    assert measured["prompt_lookup"] == tiny_engine.prompt_lookup and "1 tok/pass" in table
    assert "llama.cpp x on m.gguf" in table and "Retrieval route" in table and "full prefill of" in table
    assert "to end s" in table and "until the answer's own end-of-turn token" in table
    without_batches = engine_bench.measure(tiny_engine, corpus_manifest_path.parent / "fixed", runs=1,
                                           document_tokens=(300,))
    assert without_batches["batches"] == [] and without_batches["batch_document_tokens"] is None


def test_llama_cpp_peer_is_built_without_amx_tiles_on_amx_cpus():
    """Its AMX matmul stops with an illegal instruction here: AMX CPUs get the AVX-512 build, others native."""
    from cagflow.bench.llama_cpp_peer import cmake_args

    amx = cmake_args({"avx512f", "avx512_bf16", "amx_tile", "amx_int8"})
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AVX512=ON" in amx and "AMX" not in amx
    assert cmake_args({"avx2", "fma"}) == "-DGGML_NATIVE=ON"
