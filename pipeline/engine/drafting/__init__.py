"""Proposers: the Drafter protocol, n-gram, suffix index, draft model, hybrid, the adaptive policy."""
