"""The model side every other package builds on: documents and corpus questions, the prompt, the model,
the engine (prefill, answers, shared-prefix decoding) and the snapshot format."""
