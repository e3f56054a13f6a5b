"""Prefix keys: requests that share a long leading prompt get one key; requests with nothing shared get none."""

from __future__ import annotations

from pipeline.stages.prefix_key import MIN_PREFIX_CHARS, PREFIX_CHARS, prefix_key

CHAT = "/v1/chat/completions"
SYSTEM = "You are a careful assistant. " * 20  # ~560 characters


def chat(*messages: tuple[str, str], **body) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **body}


def test_same_system_prompt_same_key_whatever_the_question():
    a = prefix_key(CHAT, chat(("system", SYSTEM), ("user", "What is 2+2?")))
    b = prefix_key(CHAT, chat(("system", SYSTEM), ("user", "Name a color.")))
    assert a is not None and a == b


def test_different_system_prompts_differ():
    a = prefix_key(CHAT, chat(("system", SYSTEM), ("user", "q")))
    b = prefix_key(CHAT, chat(("system", SYSTEM + "Be brief."), ("user", "q")))
    assert a and b and a != b


def test_few_shot_turns_are_part_of_the_prefix():
    shots = [
        ("user", "Translate 'cat' " * 20),
        ("assistant", "chat"),
        ("user", "Translate 'dog'"),
        ("assistant", "chien"),
    ]
    a = prefix_key(CHAT, chat(*shots, ("user", "Translate 'bird'")))
    b = prefix_key(CHAT, chat(*shots, ("user", "Translate 'fish'")))
    c = prefix_key(CHAT, chat(*shots[:2], ("user", "Translate 'fish'")))
    assert a == b and a != c


def test_long_shared_prefix_is_cut_so_prompts_parting_late_still_group():
    head = "x" * PREFIX_CHARS
    a = prefix_key(CHAT, chat(("system", head + "tail one"), ("user", "q")))
    b = prefix_key(CHAT, chat(("system", head + "tail two"), ("user", "q")))
    assert a == b


def test_short_or_single_prompts_get_no_key():
    assert prefix_key(CHAT, chat(("user", "What is 2+2?"))) is None
    assert prefix_key(CHAT, chat(("system", "Be brief."), ("user", "q"))) is None  # too short to pay
    assert prefix_key(CHAT, chat(("system", "s" * (MIN_PREFIX_CHARS - 20)), ("user", "q"))) is None
    assert prefix_key("/v1/completions", {"prompt": "Once upon a time"}) is None
    assert prefix_key(CHAT, {"messages": []}) is None
    assert prefix_key("/v1/completions", {"prompt": [1, 2, 3]}) is None


def test_a_long_single_prompt_is_keyed_by_its_head():
    preamble = "Instructions: " + "answer exactly. " * 80
    a = prefix_key("/v1/completions", {"prompt": preamble + "Q: one"})
    b = prefix_key("/v1/completions", {"prompt": preamble + "Q: two"})
    assert a is not None and a == b
    assert prefix_key(CHAT, chat(("user", preamble + "Q: one"))) != a  # routes render differently


def test_tools_count_as_leading_text():
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 60}} for i in range(4)
    ]
    a = prefix_key(CHAT, chat(("user", "q1"), tools=tools))
    b = prefix_key(CHAT, chat(("user", "q2"), tools=tools))
    assert a is not None and a == b


def test_content_parts_are_read_as_text():
    parts = [{"type": "text", "text": SYSTEM}]
    assert prefix_key(CHAT, chat(("system", parts), ("user", "q"))) == prefix_key(  # type: ignore[arg-type]
        CHAT, chat(("system", SYSTEM), ("user", "q"))
    )
