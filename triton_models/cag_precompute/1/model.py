"""Triton Python backend model ``cag_precompute``: computes and stores a document's snapshots on serving
hardware. The logic lives in ``cagflow.offline.precompute``; ``cagflow.inference.triton`` reads and writes
the tensors."""

import logging
import time

import triton_python_backend_utils as pb_utils
from cagflow.inference import triton as tb
from cagflow.inference.service import Runtime
from cagflow.offline.precompute import precompute_document

log = logging.getLogger("cagflow.precompute")


class TritonPythonModel:
    def initialize(self, args):
        self.settings = tb.settings_from_args(args)
        tb.configure_logging(self.settings.instance_name)
        self.runtime = Runtime.load(self.settings, role="writer")
        log.info("ready: model %s, store %s", self.runtime.engine.fingerprint[:16], self.runtime.store.url)

    def execute(self, requests):
        responses = []
        for request in requests:
            request_id = request.request_id()
            try:
                document = tb.read_document_request(pb_utils, request)
                started = time.perf_counter()
                results = precompute_document(self.runtime.engine, self.runtime.store, document.doc_id,
                                              document.doc_version, document.parse(), document.force)
                seconds = time.perf_counter() - started
                log.info("%s %s: %d parts (%d new) in %.1f s", document.doc_id, document.doc_version, len(results),
                         sum(not r.skipped for r in results), seconds)
                outputs = tb.precompute_outputs(pb_utils, results, seconds)
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
            except Exception as exc:
                responses.append(tb.error_response(pb_utils, exc, request_id))
        return responses
