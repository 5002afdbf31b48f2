"""Cloud TPU launch: checks before billing, the bundle the workers run, the agent on every host, status."""
