"""`/v1/audio/transcriptions` and `/v1/audio/translations`: an audio file in, its text out (a speech-to-text model
such as Whisper).

A batch line names its audio by `file_url`, exactly as vLLM's run-batch takes it (an http(s) URL, a base64 `data:`
URL, or a `file://` path where the fetch policy allows one): OpenAI's own API uploads the file as a form, which a
batch line cannot hold. The engine fetches the file under the job's media policy and hands the bytes to vLLM's
speech-to-text serving object, as run-batch does.

Usage of these routes is in seconds of audio (`{"type": "duration", "seconds": 1}`), not tokens: such rows count
no prompt or completion tokens.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pipeline.endpoints.base import (
    SAMPLING_FIELDS,
    STREAM_FIELD,
    Budget,
    Endpoint,
    FakeAnswer,
    FakeContext,
    Prompt,
    Templated,
    Text,
    VllmBinding,
    fake_text,
    open_ended_budget,
)

# The audio's own URL schemes; the policy decides which hosts and paths each may reach.
FILE_URL_SCHEMES = ("http://", "https://", "data:", "file://")
# Sampling fields the speech-to-text request models read (no top_logprobs or max_tokens: max_completion_tokens).
_SAMPLING = (
    "temperature top_p top_k min_p seed max_completion_tokens n presence_penalty frequency_penalty "
    "repetition_penalty"
).split()
# The body fields of vLLM's speech-to-text requests as run-batch reads them (its model keeps the form's `file`, refused).
_SPEECH_FIELDS = (
    "file file_url frequency_penalty hotwords include_stop_str_in_output language length_penalty max_completion_tokens "
    "min_p model n presence_penalty prompt repetition_penalty response_format seed stream stream_continuous_usage_stats "
    "stream_include_usage temperature to_language top_k top_p use_beam_search vllm_xargs watermarking"
).split()
# Every answer's keys: the text, and for verbose_json the language, duration, segments and words (diarized_json:
# the task, duration and segments).
_ANSWER_KEYS = frozenset({"text", "usage", "language", "duration", "segments", "words", "task"})


class _SpeechToText(Endpoint):
    tasks = frozenset({"transcription"})
    generates = True
    fields = {**STREAM_FIELD, **{name: SAMPLING_FIELDS[name] for name in _SAMPLING}}
    # A dataset job: each row's audio (--audio-column); the template, if any, is the decoder's prompt.
    templated = Templated(
        system=False, pair=False, media=frozenset({"audio"}), needs_text=False, needs_media="audio"
    )

    def templated_body(self, prompt: str | None, system: str | None, pair: str | None) -> dict[str, Any]:
        return {"prompt": prompt} if prompt else {}

    def with_media(self, body: dict[str, Any], kind: str, urls: list[str]) -> dict[str, Any] | str:
        if len(urls) != 1:
            return f"a {self.name} request takes one audio file, and this row has {len(urls)}"
        return {**body, "file_url": urls[0]}

    def check(self, body: dict[str, Any]) -> str | None:
        if "file" in body:
            return (
                f"body.file is not supported in a batch: give the audio as body.file_url (for {self.urls[0]})"
            )
        url = body.get("file_url")
        if not isinstance(url, str) or not url:
            return f"body.file_url is required for {self.urls[0]} (an http(s) URL or a base64 data: URL)"
        if not url[:8].lower().startswith(FILE_URL_SCHEMES):
            return f"body.file_url must be an http(s), data: or file:// URL, got {url[:40]!r}"
        return None

    def prompts(self, body: dict[str, Any], pairwise: bool = False) -> list[Prompt]:
        # The audio is the encoder's input, outside the decoder's context; what the decoder starts from is the
        # optional prompt (after the task's few special tokens).
        prompt = body.get("prompt")
        return [Text(prompt if isinstance(prompt, str) else "")]

    def output_budget(self, body: dict[str, Any], budget: Budget) -> tuple[int, bool]:
        requested = body.get("max_completion_tokens")
        return open_ended_budget(requested if isinstance(requested, int) else None, budget)

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        # The fake engine cannot hear: the text is derived from the file's URL (the same file, the same text).
        digest = hashlib.sha256(str(body.get("file_url")).encode("utf-8", "surrogatepass")).hexdigest()
        requested = body.get("max_completion_tokens")
        text = fake_text(
            f"{self.name}:{digest}", requested if isinstance(requested, int) else ctx.output_tokens
        )
        answer: dict[str, Any] = {"text": text, "usage": {"type": "duration", "seconds": 1}}
        if body.get("response_format") == "verbose_json":
            answer = {"duration": 1.0, "language": body.get("language") or "en", "text": text, "segments": [],
                      "words": None}  # fmt: skip
        return FakeAnswer(answer, 0, 0)

    def usage(self, body: dict[str, Any]) -> tuple[int, int]:
        return 0, 0  # seconds of audio, not tokens

    def answers(self, body: dict[str, Any]) -> bool:
        return isinstance(body.get("text"), str) and set(body) <= _ANSWER_KEYS

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"content": body.get("text")}

    def output_texts(self, body: dict[str, Any]) -> list[str]:
        text = body.get("text")
        return [text] if isinstance(text, str) else []


class Transcriptions(_SpeechToText):
    """Speech to text in the audio's own language. A translation's answer has the same shape: result rows of
    either route are listed as this one's (the `route` column is read from the answer, which does not tell)."""

    name = "transcriptions"
    urls = ("/v1/audio/transcriptions",)
    vllm = VllmBinding(
        request="vllm.entrypoints.launchers.run_batch:BatchTranscriptionRequest",
        serving="openai_serving_transcription",
        method="create_transcription",
        response="vllm.entrypoints.speech_to_text.transcription.protocol:TranscriptionResponse",
        file_url="vllm.entrypoints.speech_to_text.transcription.protocol:TranscriptionRequest",
    )
    body_fields = frozenset([*_SPEECH_FIELDS, "timestamp_granularities", "timestamp_granularities[]"])


class Translations(_SpeechToText):
    """Speech to English text."""

    name = "translations"
    urls = ("/v1/audio/translations",)
    vllm = VllmBinding(
        request="vllm.entrypoints.launchers.run_batch:BatchTranslationRequest",
        serving="openai_serving_translation",
        method="create_translation",
        response="vllm.entrypoints.speech_to_text.translation.protocol:TranslationResponse",
        file_url="vllm.entrypoints.speech_to_text.translation.protocol:TranslationRequest",
    )
    body_fields = frozenset(_SPEECH_FIELDS)

    def answers(self, body: dict[str, Any]) -> bool:
        return False  # the same shape as a transcription: Transcriptions answers for both
