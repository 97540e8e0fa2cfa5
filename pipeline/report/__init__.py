"""Reports over a run's Parquet output: summary, statistics, plots."""
