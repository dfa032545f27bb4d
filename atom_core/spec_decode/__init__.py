"""Speculative decoding: proposers draft tokens, the target verifies them in one forward and
the rejection sampler keeps its distribution; the scheduler only budgets tokens for them."""
