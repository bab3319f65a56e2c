"""Documents as the system stores them: parsing into sections, sentences and words (one definition of Han
text), snapshot keys, and the snapshot file format."""
