"""The actor: log-probs with route replay, policy updates, and the group of ranks that runs them."""
