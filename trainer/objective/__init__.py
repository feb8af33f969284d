"""The objective: advantages, policy losses, rollout correction and the statistics they share."""
