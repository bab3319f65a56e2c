"""Triton Python backend model ``cag_llm_stream`` (decoupled): streams an answer's text as it is decoded,
then sends the final record; ``ACTION=reload`` switches releases. The logic lives in ``cagflow.inference``."""

import asyncio
import time
from contextlib import aclosing

import triton_python_backend_utils as pb_utils
from cagflow.inference import triton as tb
from cagflow.inference.concurrency import iterate_in_thread

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.serving = tb.Serving.start(pb_utils, args)

    async def execute(self, requests):
        """Decoupled: every request streams on its own; Triton runs the next execute meanwhile."""
        await asyncio.gather(*(self._stream(request) for request in requests))
        return None

    async def _stream(self, request):
        sender = request.get_response_sender()
        request_id = request.request_id()
        received, answered = time.perf_counter(), False
        try:
            if tb.read_action(pb_utils, request) == "reload":
                sender.send(await self.serving.reload_response(pb_utils, request), flags=FINAL)
                return
            question = tb.read_answer_request(pb_utils, request)
            request_id = question.request_id
            stream = iterate_in_thread(self.serving.pool, lambda: self.serving.service.stream(question))
            async with aclosing(stream) as items:
                async for item in items:
                    if sender.is_cancelled():
                        sender.send(flags=FINAL)
                        return
                    if isinstance(item, str):
                        sender.send(pb_utils.InferenceResponse(output_tensors=tb.text_piece_outputs(pb_utils, item)))
                    else:
                        outputs = tb.answer_outputs(pb_utils, item)
                        sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL)
                        answered = True
                        tb.trace_answer(self.serving.settings.model_name, tb.trace_parent(request), received, item)
        except Exception as exc:
            if not answered:
                tb.trace_answer(self.serving.settings.model_name, tb.trace_parent(request), received, exc)
            sender.send(tb.error_response(pb_utils, exc, request_id), flags=FINAL)
        finally:
            self.serving.metrics.publish()

    def finalize(self):
        self.serving.close()
