"""A generation job: its config, one input row to one engine request, building the engine."""
