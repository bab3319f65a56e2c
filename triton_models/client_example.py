"""Talk to the CAGFlow models on Triton: answers over HTTP, streamed answers over gRPC, release reloads and
precompute. Every input is a batch of one: shape [1, 1].

    python triton_models/client_example.py --http 127.0.0.1:8000 ask "Which port does the web console use?" \\
        --key skerry-admin-manual
    python triton_models/client_example.py --grpc 127.0.0.1:8001 stream "Which port does the web console use?" \\
        --key skerry-admin-manual
    python triton_models/client_example.py --http 127.0.0.1:8000 ask "Which port?" \\
        --context '[{"text": "The console listens on 8443.", "title": "Admin manual"}]'
    python triton_models/client_example.py --http 127.0.0.1:8000 reload [--release-id ID]
    python triton_models/client_example.py --http 127.0.0.1:8000 precompute corpus/fixed/support-faq.md \\
        --doc-id support-faq --version 1.7.0
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

_DTYPES = {str: ("BYTES", np.object_), int: ("INT32", np.int32), bool: ("BOOL", np.bool_)}


def make_inputs(module, **values) -> list:
    """One [1, 1] tensor per non-empty value; names are the upper-cased keywords."""
    inputs = []
    for name, value in values.items():
        if value is None or value == "":
            continue
        datatype, dtype = _DTYPES[type(value)]
        tensor = module.InferInput(name.upper(), [1, 1], datatype)
        tensor.set_data_from_numpy(np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype))
        inputs.append(tensor)
    return inputs


def outputs_of(result) -> dict:
    """Every output of a response as plain Python values (lists for TOKEN_IDS and SNAPSHOT_KEYS)."""
    response = result.get_response()
    names = [output["name"] if isinstance(output, dict) else output.name for output in
             (response["outputs"] if isinstance(response, dict) else response.outputs)]
    values = {}
    for name in names:
        flat = [item.decode() if isinstance(item, bytes) else item.item() for item in result.as_numpy(name).reshape(-1)]
        values[name] = flat if name in ("TOKEN_IDS", "SNAPSHOT_KEYS") else flat[0]
    return values


def ask(http_url: str, question: str, snapshot_key: str = "", context: str = "", max_new_tokens: int | None = None,
        request_id: str = "") -> dict:
    """One answer from ``cag_llm``: from a snapshot (``snapshot_key``: a key or a doc_id), from passages
    (``context``: JSON), or from the question alone."""
    client = httpclient.InferenceServerClient(http_url)
    try:
        inputs = make_inputs(httpclient, question=question, snapshot_key=snapshot_key, context=context,
                             max_new_tokens=max_new_tokens, request_id=request_id)
        return outputs_of(client.infer("cag_llm", inputs))
    finally:
        client.close()


def reload(http_url: str, release_id: str = "") -> dict:
    """Switch ``cag_llm`` to ``release_id`` (default: the store's current release)."""
    client = httpclient.InferenceServerClient(http_url)
    try:
        return outputs_of(client.infer("cag_llm", make_inputs(httpclient, action="reload", release_id=release_id)))
    finally:
        client.close()


def precompute(http_url: str, doc_id: str, version: str, document: str, format: str = "md", title: str = "",
               force: bool = False) -> list[dict]:
    """Compute and store a document's snapshots on the server; returns one release entry per part."""
    client = httpclient.InferenceServerClient(http_url, network_timeout=600.0, connection_timeout=600.0)
    try:
        inputs = make_inputs(httpclient, doc_id=doc_id, doc_version=version, document=document, format=format,
                             title=title, force=force or None)
        return json.loads(outputs_of(client.infer("cag_precompute", inputs, timeout=600))["ENTRIES"])
    finally:
        client.close()


def stream_responses(grpc_url: str, model: str = "cag_llm_stream", timeout_s: float = 300.0,
                     **values) -> Iterator[dict]:
    """Every response of one request to a decoupled model, as output dicts; raises the server's error."""
    client = grpcclient.InferenceServerClient(grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, make_inputs(grpcclient, **values), enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                raise error
            response = result.get_response()
            if response.outputs:
                yield outputs_of(result)
            if response.parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def stream(grpc_url: str, question: str, snapshot_key: str = "", context: str = "",
           max_new_tokens: int | None = None, request_id: str = "") -> Iterator[str | dict]:
    """Text pieces of the answer as they are decoded, then the final record (the outputs of ``ask``)."""
    for outputs in stream_responses(grpc_url, question=question, snapshot_key=snapshot_key, context=context,
                                    max_new_tokens=max_new_tokens, request_id=request_id):
        yield outputs if "ANSWER" in outputs else outputs["TEXT"]


def reload_streaming(grpc_url: str, release_id: str = "") -> dict:
    """Switch ``cag_llm_stream`` (a separate process with its own resident set) to ``release_id``."""
    return next(stream_responses(grpc_url, action="reload", release_id=release_id))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--http", default="127.0.0.1:8000", help="Triton HTTP address")
    parser.add_argument("--grpc", default="127.0.0.1:8001", help="Triton gRPC address")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("ask", "stream"):
        command = commands.add_parser(name)
        command.add_argument("question")
        command.add_argument("--key", default="", help="snapshot key or doc_id of the active release")
        command.add_argument("--context", default="", help="retrieved passages as a JSON list")
        command.add_argument("--max-new-tokens", type=int)
    reload_command = commands.add_parser("reload")
    reload_command.add_argument("--release-id", default="")
    precompute_command = commands.add_parser("precompute")
    precompute_command.add_argument("path", type=Path)
    precompute_command.add_argument("--doc-id", required=True)
    precompute_command.add_argument("--version", required=True)
    precompute_command.add_argument("--title", default="")
    precompute_command.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "ask":
            print(json.dumps(ask(args.http, args.question, args.key, args.context, args.max_new_tokens), indent=2))
        elif args.command == "stream":
            for item in stream(args.grpc, args.question, args.key, args.context, args.max_new_tokens):
                if isinstance(item, str):
                    print(item, end="", flush=True)
                else:
                    reused = f"{item['REUSED_TOKENS']}/{item['PROMPT_TOKENS']} prompt tokens reused"
                    print(f"\n[{item['ROUTE']} · {reused} · TTFT {item['TTFT_MS']:.0f} ms · "
                          f"release {item['RELEASE_ID'] or '-'} · {item['ANSWER_SOURCE']}]", file=sys.stderr)
        elif args.command == "reload":
            result = reload(args.http, args.release_id)
            print(result["RELEASE_ID"], result["STATUS"])
        else:
            entries = precompute(args.http, args.doc_id, args.version, args.path.read_text(encoding="utf-8"),
                                 args.path.suffix.lstrip(".") or "md", args.title, args.force)
            print(json.dumps(entries, indent=2))
    except InferenceServerException as exc:
        print(f"error: {exc.message()} ({exc.status()})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
