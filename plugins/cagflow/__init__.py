"""CAGFlow: question answering from precomputed KV caches, with retrieval fallback."""
