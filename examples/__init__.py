"""Worked examples of bringing your own data and model (README, "Your own model")."""
