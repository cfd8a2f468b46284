"""Deepgram's listen API messages, as typed models of their wire form (field for field from
Deepgram's API reference; the official SDK's models check them in tests/test_deepgram.py).

TypedDicts: they are the JSON objects themselves, so building one costs nothing on the hot
path, and a misspelt or missing field is a type error.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict


class DeepgramWord(TypedDict):
    word: str  # lowercase, no punctuation around it
    start: float  # seconds
    end: float
    confidence: float
    punctuated_word: NotRequired[str]  # with punctuate / smart_format


class Alternative(TypedDict):
    transcript: str
    confidence: float
    words: list[DeepgramWord]


class Channel(TypedDict):
    alternatives: list[Alternative]


class ResultMetadata(TypedDict):
    request_id: str
    model_info: dict[str, Any]
    model_uuid: str


class Results(TypedDict):
    type: Literal["Results"]
    channel_index: list[int]
    duration: float
    start: float
    is_final: bool
    speech_final: bool
    from_finalize: bool
    channel: Channel
    metadata: ResultMetadata
    seq: int  # Voxtide's: the last one received, for a resume


class PrerecordedMetadata(TypedDict):
    """A request's metadata: pre-recorded `metadata`, and the body of live `Metadata`."""

    transaction_key: str
    request_id: str
    sha256: str
    created: str
    duration: float
    channels: int
    models: list[str]
    model_info: dict[str, Any]


class Metadata(PrerecordedMetadata):
    type: Literal["Metadata"]
    num_finals: int  # Voxtide's


class UtteranceEnd(TypedDict):
    type: Literal["UtteranceEnd"]
    channel: list[int]
    last_word_end: float


class SpeechStarted(TypedDict):
    type: Literal["SpeechStarted"]
    channel: list[int]
    timestamp: float


class Error(TypedDict):
    type: Literal["Error"]
    variant: str
    code: str
    description: str


class Connected(TypedDict):
    """Voxtide's, with voxtide_events=true: the session and its resume token."""

    type: Literal["Connected"]
    session_id: str
    resume_token: str | None
    sample_rate: int
    encoding: str
    model: str
    resumed: NotRequired[bool]
    last_seq: NotRequired[int]
    audio_received_samples: NotRequired[int]
    audio_received_ms: NotRequired[int]


class Warning(TypedDict):  # noqa: A001 (Deepgram's name)
    """Voxtide's, with voxtide_events=true: the server is behind this session
    (`rate_limited`), or stopped reading it to shut down (`server_shutting_down`)."""

    type: Literal["Warning"]
    code: str
    description: str
    backlog_ms: NotRequired[int]
    audio_received_samples: NotRequired[int]


ListenEvent = Results | Metadata | UtteranceEnd | SpeechStarted | Error | Connected | Warning


class Utterance(TypedDict):
    """Pre-recorded: `results.utterances[]`."""

    start: float
    end: float
    confidence: float
    channel: int
    transcript: str
    words: list[DeepgramWord]
    id: str


class PrerecordedResults(TypedDict):
    channels: list[Channel]
    utterances: NotRequired[list[Utterance]]


class PrerecordedResponse(TypedDict):
    metadata: PrerecordedMetadata
    results: PrerecordedResults
