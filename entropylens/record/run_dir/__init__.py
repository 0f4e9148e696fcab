"""The run directory: run.json and each rank's status, and the claim that one run writes it."""
