"""Staged results: engine actors write their finished chunks under `_staging/` themselves (`sink.py`), and a resumed
job lists what is still to run against what is staged (`pending.py`, a Ray Data join on the cluster)."""
