"""nightshift: self-hosted batch LLM inference (OpenAI Batch files in, sorted sharded results out).

The Python call (pipeline/api.py) is exported here, imported only when first used: `import pipeline` stays light
for the command line and for every Ray worker that imports a module of the package.

    import pipeline
    result = pipeline.run("job.yaml")
    answered = pipeline.run_table(df, template="Summarise: {{ text }}")
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("run", "run_table", "run_dataset", "RunResult", "NightshiftSetupError")
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        from pipeline import api

        return getattr(api, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
