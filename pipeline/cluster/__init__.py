"""The distributed job: generation worker actors and the driver that feeds them units."""
