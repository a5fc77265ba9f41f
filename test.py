"""Evaluation process: greedy test episodes, logging, checkpoints (next issue)."""
