"""Read → validate → measure → stage the work list. Ray tasks on the cluster do the per-row work (`tasks.py`,
`dedup.py`), measuring requests as fitting counts them (`measure.py`); the driver merges only aggregates and fits
the engine args to them (`fit.py`)."""
