"""Training worker (Hogwild A3C-LSTM); arrives with the training-system issue."""
