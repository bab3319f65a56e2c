"""Finding passages: chunking, embeddings, the OpenSearch index with hybrid search, in-scope detection."""
