"""Running a Hugging Face decoder over the slot store: the runner, prefill, attention routing."""
