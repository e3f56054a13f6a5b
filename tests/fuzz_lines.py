"""Generators of hostile input lines: malformed, truncated, oversized, unicode-heavy — shared by the fuzz tests."""

from __future__ import annotations

import json
import random

from hypothesis import strategies as st

from tests.conftest import chat_line, completion_line

UNICODE = "ünïcødé 日本語 한국어 العربية 🚀🔥 \u200b\u202e \\ \" ' \t"


def _valid(i: int, rng: random.Random) -> str:
    text = "".join(rng.choice(UNICODE) for _ in range(rng.randint(1, 40)))
    if rng.random() < 0.2:
        return completion_line(f"c-{i}-{text[:3]}", text, max_tokens=rng.randint(1, 8))
    return chat_line(f"id-{i}-{text[:5]}", text, max_tokens=rng.randint(1, 8))


def _mutate(line: str, rng: random.Random) -> str:
    kind = rng.randrange(9)
    if kind == 0:
        return line[: rng.randrange(len(line))]  # truncated
    if kind == 1:
        return line.replace('"custom_id"', '"custom-id"')
    if kind == 2:
        obj = json.loads(line)
        obj["body"]["temperature"] = rng.choice([-1, "hot", None, 1e309, [], {}])
        return json.dumps(obj)
    if kind == 3:
        return json.dumps([json.loads(line)])  # valid JSON, wrong shape
    if kind == 4:
        obj = json.loads(line)
        obj["body"]["messages"] = "x" * rng.randint(10_000, 100_000)  # oversized and wrong type
        return json.dumps(obj)
    if kind == 5:
        return line.replace("/v1/", "/v2/")
    if kind == 6:
        obj = json.loads(line)
        obj["custom_id"] = rng.choice([0, None, "", ["a"], "\ud800"])
        return json.dumps(obj)
    if kind == 7:
        return "".join(rng.choice(UNICODE) for _ in range(rng.randint(1, 200)))
    return line + rng.choice(["}", "]", ",", "garbage"])


def hostile_corpus(n: int, seed: int = 0) -> list[str]:
    """n lines, about half valid (with duplicate custom_ids sprinkled in), half broken in varied ways."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        line = _valid(i, rng)
        roll = rng.random()
        if roll < 0.45:
            line = _mutate(line, rng)
        elif roll < 0.5 and lines:
            line = rng.choice(lines)  # a repeat: duplicate custom_id (or the same garbage)
        lines.append(line.replace("\n", " "))
    return lines


# For property tests: arbitrary text lines, JSON-ish lines, and mutated valid ones.
line_strategy = st.one_of(
    st.text(max_size=300),
    st.builds(lambda seed, i: hostile_corpus(1, seed)[0], st.integers(0, 10_000), st.integers()),
    st.recursive(
        st.none() | st.booleans() | st.floats(allow_nan=True) | st.text(max_size=20) | st.integers(),
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
        ),
        max_leaves=20,
    ).map(lambda obj: json.dumps(obj)),
).map(lambda line: line.replace("\n", " "))
