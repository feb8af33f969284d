"""What the RL loop drives besides the actor: rollout backends, prompts, async generation, agents."""
