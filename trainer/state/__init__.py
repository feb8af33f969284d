"""What a run leaves on disk: resumable checkpoints and the run directory."""
