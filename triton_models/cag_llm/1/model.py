"""Triton Python backend model ``cag_llm``: answers from a resident KV-cache snapshot, retrieved passages
or the question alone; ``ACTION=reload`` switches releases. The logic lives in ``cagflow.triton_backend``."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from cagflow import triton_backend as tb


class TritonPythonModel:
    def initialize(self, args):
        self.settings = tb.ServingSettings.from_triton(args)
        tb.configure_logging(self.settings.instance_name)
        self.metrics = tb.TritonMetrics(pb_utils, self.settings.model_name, self.settings.instance_name)
        self.service = tb.CagService.start(self.settings, listener=self.metrics)
        self.pool = ThreadPoolExecutor(self.settings.worker_threads, thread_name_prefix="cag_llm")
        self.metrics.publish()

    async def execute(self, requests):
        """One response per request; the requests of a batch are answered concurrently."""
        responses = await asyncio.gather(*(self._respond(request) for request in requests))
        self.metrics.publish()
        return list(responses)

    async def _respond(self, request):
        request_id = request.request_id()
        try:
            if tb.read_action(pb_utils, request) == "reload":
                release_id = tb.input_text(pb_utils, request, "RELEASE_ID") or None
                result = await tb.in_thread(self.pool, self.service.reload, release_id)
                return pb_utils.InferenceResponse(output_tensors=tb.reload_outputs(pb_utils, result))
            question = tb.read_answer_request(pb_utils, request)
            request_id = question.request_id
            served = await tb.in_thread(self.pool, self.service.answer, question)
            return pb_utils.InferenceResponse(output_tensors=tb.answer_outputs(pb_utils, served))
        except Exception as exc:
            return tb.error_response(pb_utils, exc, request_id)

    def finalize(self):
        self.pool.shutdown(wait=True)
        self.service.close()
        self.metrics.close()
