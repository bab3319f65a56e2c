"""The numerics: loading and preparing a model, the int8 forward pass and its kernels, shared-prefix
decoding, and the engine that prefills documents and answers over their cached state."""
