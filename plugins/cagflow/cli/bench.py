"""``cagflow bench NAME``: one subcommand per benchmark, each with only the options that benchmark reads."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from ..config import Config

BENCHMARKS = {
    "retrieval": "recall@k of BM25, vector and hybrid search",
    "routing": "in-scope detection per threshold and its calibration",
    "engine": "answer speed from a resident snapshot",
    "answers": "are the answers right, per route, through the running API (--precisions: int8 against fp32 in "
               "this process)",
    "passages": "the retrieval route with reused passage states against full prefill, on a public dataset's "
                "questions and the same passages, in this process",
    "load": "many clients at once through the running API, and the servers' memory (exit 1 on an unintended error)",
    "faults": "faults injected into a stack of its own on 127.0.0.1 while requests are in flight (exit 1 when a "
              "scenario does not hold)",
    "plot": "time to first token per route against prompt tokens, from saved `answers --dataset` results",
}


def cmd_search(args: argparse.Namespace, config: Config) -> int:
    """retrieval and routing: measured against the running OpenSearch on the sample questions."""
    from ..bench import search as benchmarks
    from ..bench.report import save_report
    from ..search.retrieval import RetrievalUnavailable

    measure, show = {"retrieval": (benchmarks.retrieval_recall, benchmarks.print_retrieval_table),
                     "routing": (benchmarks.routing_calibration, benchmarks.print_routing_table)}[args.which]
    try:
        report = measure(config, Path(config.corpus.manifest).parent / "qa.jsonl")
    except RetrievalUnavailable as exc:
        raise ValueError(f"{exc}; start one with `cagflow opensearch up` (or set retrieval.endpoint)") from None
    show(report)
    saved = save_report(args.which, report)
    if saved:
        print(f"saved {saved}")
    return 0


def cmd_benchmark(args: argparse.Namespace, config: Config) -> int:
    """engine, answers, load, faults: ``main(config, args)`` of the bench module of that name, imported only
    now (the engine bench loads torch)."""
    return importlib.import_module(f"..bench.{args.which}", __package__).main(config, args)


def _add_engine(engine: argparse.ArgumentParser) -> None:
    engine.add_argument("--model", help="a model preset or path (default: model.path of the configuration)")
    engine.add_argument("--runs", type=int, default=3, help="short runs per cell; the median is reported")
    engine.add_argument("--peer", choices=("llama-cpp",),
                        help="also run llama.cpp (llama-cpp-python, built once into its own virtual environment) "
                             "on the same GGUF file, prompts and threads, in the same run")
    engine.add_argument("--document-tokens", type=int, nargs="+", metavar="N",
                        help="document sizes to measure (default: 512 2048 4096 7800); batches and the serving "
                             "layer are measured over the 2048-token one, when it is among them")


def _add_answers(answers: argparse.ArgumentParser) -> None:
    answers.add_argument("--precisions", action="store_true",
                         help="compare int8 and fp32 answers from snapshots in this process")
    answers.add_argument("--model", help="with --precisions: a model preset or path (default: model.path of the "
                                         "configuration)")
    answers.add_argument("--limit", type=int, help="ask only the first N questions")
    answers.add_argument("--kind", action="append", help="ask only questions of this kind (fact, near_miss, "
                         "near_miss_absent, unanswerable, conflict; repeatable)")
    answers.add_argument("--only", help="ask only these question ids (q001,q002,... or dataset ids)")
    answers.add_argument("--language", choices=("en", "zh"), help="ask only the questions in this language")
    answers.add_argument("--no-full-prompt", action="store_true",
                         help="leave out the full-prompt route (a whole document prefilled per question; "
                              "token-identical to the cache route)")
    answers.add_argument("--auto-only", action="store_true",
                         help="ask each question once, routed by the API (no per-route comparison)")
    dataset = answers.add_argument_group("a question set of its own: --dataset, and the options only it has")
    dataset.add_argument("--dataset", metavar="NAME|PATH",
                         help="a question set of bench/datasets/ (squad2-dev, cmrc2018-trial) or a folder of the "
                              "same format, scored by its own rules; its documents are added to the running stack "
                              "when the active release lacks them (README: Measure it on your documents)")
    dataset.add_argument("--route", action="append", choices=("auto", "cache", "retrieval"),
                         help="ask on this route (repeatable; default: all three)")
    dataset.add_argument("--split", choices=("calibration", "report"),
                         help="ask only this half (split by document)")
    dataset.add_argument("--no-ingest", action="store_true",
                         help="fail instead of adding missing documents to the stack")
    dataset.add_argument("--ablate", action="store_true",
                         help="print what each answer rule did on the auto route (from the rules each answer "
                              "record says fired; always in the result JSON)")


def _passage_mode(value: str) -> str:
    if value == "prefill" or (value.startswith("reuse-") and value[6:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: prefill or reuse-N (N passages prefilled in context)")


def _add_passages(passages: argparse.ArgumentParser) -> None:
    passages.add_argument("--dataset", default="squad2-dev", metavar="NAME|PATH", help="a dataset of bench/datasets")
    passages.add_argument("--split", choices=("calibration", "report"), default="calibration",
                          help="the half of the dataset's articles to ask about (default: calibration)")
    passages.add_argument("--limit", type=int, help="ask only the first N questions")
    passages.add_argument("--modes", nargs="+", default=["reuse-0", "reuse-1", "prefill"], type=_passage_mode,
                          help="prefill, and reuse-N: passage states reused, the last N passages prefilled in "
                               "context (default: reuse-0 reuse-1 prefill)")


def _add_load(load: argparse.ArgumentParser) -> None:
    load.add_argument("--clients", type=int, help="clients asking at once in the burst (default 50)")
    load.add_argument("--duration", type=float, default=60, help="seconds of the burst (default 60)")
    load.add_argument("--soak", type=float, default=0,
                      help="then this many seconds at a lower rate, to see whether memory grows (default 0: none)")
    load.add_argument("--soak-clients", type=int, default=4, help="clients in the soak (default 4)")
    load.add_argument("--soak-pause", type=float, default=1.0,
                      help="seconds between a soak client's requests (default 1)")
    load.add_argument("--max-new-tokens", type=int, help="per answer (default: the API's)")
    load.add_argument("--stream-share", type=float, default=0.2,
                      help="share of the requests that ask for a streamed answer (default 0.2)")
    load.add_argument("--pid", action="append", metavar="NAME=PID",
                      help="sample this process group's memory as NAME (default: the router and Triton that "
                           "`cagflow router up` and `cagflow triton up` recorded); repeatable")


def _add_faults(faults: argparse.ArgumentParser) -> None:
    faults.add_argument("--scenario", action="append", metavar="NAME",
                        help="run only this scenario (repeatable; default: all of them, see bench/README.md)")
    faults.add_argument("--fault-doc-id", action="append", metavar="DOC_ID",
                        help="one of the three fixed documents of its release (give three; default: the three "
                             "smallest English ones of the manifest)")
    faults.add_argument("--model", help="a model preset or path (default: model.path of the configuration)")
    faults.add_argument("--clients", type=int, help="clients asking during each scenario (default 4)")
    faults.add_argument("--max-new-tokens", type=int, help="per answer (default 24)")


def _add_plot(plot: argparse.ArgumentParser) -> None:
    plot.add_argument("results", nargs="+", metavar="RESULT_JSON",
                      help="result files of `cagflow bench answers --dataset` (bench/results/answers-*.json)")
    plot.add_argument("--out", default="bench/ttft-per-route.png", help="the image (default: %(default)s)")


OPTIONS = {"engine": _add_engine, "answers": _add_answers, "passages": _add_passages, "load": _add_load,
           "faults": _add_faults, "plot": _add_plot}


def add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks (reported, never asserted)",
                                description="Benchmarks, printed and saved to bench/results/, never asserted. "
                                            "Each has options of its own: cagflow bench BENCHMARK --help")
    benchmarks = bench.add_subparsers(dest="which", required=True, metavar="BENCHMARK")
    for name, summary in BENCHMARKS.items():
        parser = benchmarks.add_parser(name, help=summary, description=summary)
        if name in OPTIONS:
            OPTIONS[name](parser)
        parser.set_defaults(run=cmd_benchmark if name in OPTIONS else cmd_search)
