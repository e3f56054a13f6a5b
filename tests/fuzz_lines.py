"""Generators of hostile input lines: malformed, truncated, oversized, unicode-heavy — shared by the fuzz tests."""

from __future__ import annotations

import json
import random

from hypothesis import strategies as st

from tests.lines import chat_line, completion_line

UNICODE = "ünïcødé 日本語 한국어 العربية 🚀🔥 \u200b\u202e \\ \" ' \t"


def _valid(i: int, rng: random.Random) -> str:
    text = "".join(rng.choice(UNICODE) for _ in range(rng.randint(1, 40)))
    if rng.random() < 0.2:
        return completion_line(f"c-{i}-{text[:3]}", text, max_tokens=rng.randint(1, 8))
    return chat_line(f"id-{i}-{text[:5]}", text, max_tokens=rng.randint(1, 8))


# Values other tools' request models coerce or refuse, per field: vLLM's own run-batch tests send "stream": "True".
TYPE_CONFUSED = {
    "stream": ["True", "true", 1, "yes", "false", 0, "maybe", [], {"x": 1}],
    "max_tokens": ["8", 8.0, True, 1e30, 10**30, -1, 0, 2.5, "many", None, [8]],
    "temperature": ["0.5", True, "hot", -0.1, 1e309, {}, "NaN"],
    "top_p": ["1", 0, 1.01, "nan"],
    "n": ["1", 1.0, 0, "two"],
    "seed": ["7", 2**70, -(2**64), "x"],
    "logprobs": ["true", 2, "maybe"],
    "top_logprobs": ["2", -1, 1.5],
    "stop": [1, [None], {"a": 1}],
    "messages": [
        {"role": "user"},
        [{"role": 5, "content": "x"}],
        [{"role": "user", "content": 5}],
        [[]],
        None,
    ],
    "model": [5, None, "", "gpt-4o"],
}
CONTROL = "".join(map(chr, [*range(0, 32), 127, 133, 155]))


def _deep(depth: int) -> object:
    value: object = []
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _mutate(line: str, rng: random.Random) -> str:
    kind = rng.randrange(14)
    if kind == 9:  # deep nesting: the whole line, or inside a valid envelope
        depth = rng.choice([150, 1_200, 20_000])
        if rng.random() < 0.5:
            return "[" * depth + "]" * depth
        obj = json.loads(line)
        obj["body"]["extra"] = _deep(depth)
        return json.dumps(obj) if depth < 500 else line[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
    if kind == 10:  # a type-confused field
        obj = json.loads(line)
        field = rng.choice(sorted(TYPE_CONFUSED))
        obj["body"][field] = rng.choice(TYPE_CONFUSED[field])
        return json.dumps(obj)
    if kind == 11:  # control characters in the id or the text
        obj = json.loads(line)
        noise = "".join(rng.choice(CONTROL) for _ in range(rng.randint(1, 5)))
        if rng.random() < 0.5:
            obj["custom_id"] = obj["custom_id"] + noise
        else:
            obj["body"]["messages" if "messages" in obj["body"] else "prompt"] = noise
        return json.dumps(obj)
    if kind == 12:  # huge strings: an id far past its limit, or a large prompt
        obj = json.loads(line)
        if rng.random() < 0.5:
            obj["custom_id"] = "i" * rng.randint(513, 200_000)
        else:
            obj["body"]["user"] = "z" * rng.randint(100_000, 2_000_000)
        return json.dumps(obj)
    if kind == 13:  # the envelope's own fields confused
        obj = json.loads(line)
        obj[rng.choice(["method", "url", "body"])] = rng.choice(["post", "POST ", 5, None, [], "", "GET"])
        return json.dumps(obj)
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
