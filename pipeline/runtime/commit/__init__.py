"""Staging → sorted result shards, error shards, then `manifest.json` (the commit marker): shard tasks on the
cluster, planned and committed by the driver (`finalize.py`)."""
