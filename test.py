"""Evaluation process (greedy test episodes, logging, checkpoints); arrives with the training-system issue."""
