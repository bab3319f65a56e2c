"""Triton Python backend model ``cag_llm``: answers from a resident KV-cache snapshot, retrieved passages
or the question alone; ``ACTION=reload`` switches releases. The logic lives in ``cagflow.inference``."""

import triton_python_backend_utils as pb_utils
from cagflow.inference import triton as tb


class TritonPythonModel:
    def initialize(self, args):
        self.serving = tb.Serving.start(pb_utils, args)

    async def execute(self, requests):
        """One response per request. Repeats come from the answer cache, identical questions in flight are
        computed once, and questions on the same snapshot are answered in one batched pass."""
        responses = await tb.respond(pb_utils, self.serving, requests)
        self.serving.metrics.publish()
        return responses

    def finalize(self):
        self.serving.close()
