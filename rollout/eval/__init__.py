"""`rollout-eval`: evaluate a model implementation on a dataset with continuous batching (`rollout.eval.cli`)."""
