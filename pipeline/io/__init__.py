"""Input shards in, unit outputs out: Arrow schemas, the reader (discover, plan units, stream rows)
and the writer (unit files, commit markers, manifest). Knows nothing about models or Ray."""
