"""The experiment configuration: strict section models, YAML reading, `--set` overrides."""
