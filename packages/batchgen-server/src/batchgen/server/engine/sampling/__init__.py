"""The sampler and its seeds, the running rows' sampling state, grammars (llguidance), detokenizing, prompt logprobs."""
