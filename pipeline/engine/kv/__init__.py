"""The slot KV store (rollback is a length) and the step layout every forward reads."""
