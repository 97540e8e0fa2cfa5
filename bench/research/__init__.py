"""One-off probes: each answered a question once (where a step's time goes, what a drafter would have
had accepted, which grammar library); kept to rerun by hand, not maintained with the benchmarks."""
