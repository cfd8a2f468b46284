"""The OpenAI Realtime API's transcription server events, as typed models of their wire form
(the openai SDK's GA and beta models check every one in tests/test_server.py).

TypedDicts: they are the JSON objects themselves; `RealtimeSession.emit` adds each event's
`event_id`.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict


class Content(TypedDict):
    type: Literal["input_audio"]
    transcript: str | None


class Item(TypedDict):
    """A turn: a user message of input audio."""

    id: str
    object: Literal["realtime.item"]
    type: Literal["message"]
    status: Literal["completed"]
    role: Literal["user"]
    content: list[Content]


class Usage(TypedDict):
    type: Literal["duration"]
    seconds: float


class ErrorDetail(TypedDict):
    type: str  # server_error or invalid_request_error
    code: str
    message: str
    param: str | None
    event_id: str | None


class SessionEvent(TypedDict):
    type: Literal["session.created", "session.updated", "transcription_session.updated"]
    session: dict[str, Any]  # GA and beta fields side by side (RealtimeSession.session_object)


class SpeechStarted(TypedDict):
    type: Literal["input_audio_buffer.speech_started"]
    audio_start_ms: int
    item_id: str


class SpeechStopped(TypedDict):
    type: Literal["input_audio_buffer.speech_stopped"]
    audio_end_ms: int
    item_id: str


class Committed(TypedDict):
    type: Literal["input_audio_buffer.committed"]
    previous_item_id: str | None
    item_id: str


class Cleared(TypedDict):
    type: Literal["input_audio_buffer.cleared"]


class ItemEvent(TypedDict):
    type: Literal["conversation.item.added", "conversation.item.created", "conversation.item.done"]
    previous_item_id: str | None
    item: Item


class TranscriptionDelta(TypedDict):
    type: Literal["conversation.item.input_audio_transcription.delta"]
    item_id: str
    content_index: int
    delta: str


class TranscriptionCompleted(TypedDict):
    type: Literal["conversation.item.input_audio_transcription.completed"]
    item_id: str
    content_index: int
    transcript: str
    usage: Usage


class ErrorEvent(TypedDict):
    type: Literal["error"]
    error: ErrorDetail


ServerEvent = (SessionEvent | SpeechStarted | SpeechStopped | Committed | Cleared | ItemEvent
               | TranscriptionDelta | TranscriptionCompleted | ErrorEvent)


def item(item_id: str, transcript: str | None) -> Item:
    return Item(id=item_id, object="realtime.item", type="message", status="completed", role="user",
                content=[Content(type="input_audio", transcript=transcript)])
