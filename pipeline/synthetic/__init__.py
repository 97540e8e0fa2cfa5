"""The scheduled synthetic-data job: slots, templates, the quality gate."""
