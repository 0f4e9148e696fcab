"""The maths: log-probs and entropy over the vocabulary, the policy losses, the exact step aggregates."""
