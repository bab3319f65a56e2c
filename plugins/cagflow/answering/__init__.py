"""The answer policy, without the model: the prompt and its wordings, the grounding checks that decline an
unsupported answer, the answer record and the corpus questions."""
