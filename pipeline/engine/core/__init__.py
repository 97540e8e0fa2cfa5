"""Bookkeeping and the pure rules: requests, scheduling, prefix index, sampling, verification."""
