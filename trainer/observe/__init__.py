"""What a run shows: metrics and plots, W&B, expert load, non-finite checks, dumps, diagnosis."""
