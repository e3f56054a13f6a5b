"""A table answered from Python: each review gets a one-word sentiment, the table comes back with its answers.

    .venv/bin/python examples/table.py            # the embedded SmolLM2-135M-Instruct, a local Ray

The same job from the command line:

    nightshift run examples/reviews.jsonl out/reviews --template "{{ review }}" --system "..." --max-tokens 3
"""

from __future__ import annotations

from typing import Any

import pandas as pd

import pipeline

SYSTEM = "Answer with one word: positive, negative or mixed."
TEMPLATE = "Review of a {{ product }}: {{ review }}"


def sentiments(reviews: pd.DataFrame, **job: Any) -> pd.DataFrame:
    """`reviews` with the model's answer in `content` (and `error` for a review that could not be asked about)."""
    return pipeline.run_table(
        reviews, job=job or None, template=TEMPLATE, system=SYSTEM, max_tokens=3, temperature=0
    )


if __name__ == "__main__":
    from pathlib import Path

    reviews = pd.read_json(Path(__file__).with_name("reviews.jsonl"), lines=True)
    answered = sentiments(reviews)
    print(answered[["id", "product", "content", "error"]].to_string(index=False))
