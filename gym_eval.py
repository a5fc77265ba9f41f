"""Evaluate a saved model over many episodes; arrives with the training-system issue."""
