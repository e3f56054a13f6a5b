"""The engine actors and what feeds them. The driver launches each pool (`launch.py`, `placement.py`); every engine
actor (`engine_actor.py`, one engine each) pulls leased chunks from the `WorkQueue` actor (`work_queue.py`), keeps
its in-flight window full (`inflight.py`) and reports to the job's `JobMonitor` actor (`monitor.py`). A long-lived
server keeps engines warm between jobs in an `EngineKeeper` actor (`warm_keeper.py`)."""
