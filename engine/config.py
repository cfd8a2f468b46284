"""Engine tuning: one dataclass, and the values derived from it, resolved in one place.

These are expert settings: `voxtide serve` takes them from a TOML file (`--config FILE`,
table [engine]) or from VOXTIDE_<NAME> environment variables (app/config.py). The defaults
are the ones the figures in docs/performance.md were measured with.
"""

from __future__ import annotations

from dataclasses import dataclass

from audio.frames import ITEM_SAMPLES
from engine.model.beam import check_beam_size
from engine.model.decoding import MAX_PROMPT_TOKENS
from engine.scheduler import SchedulerConfig
from engine.timeline import item_positions, ms_to_positions, seconds_to_positions

CPU_MAX_FINALS = 2  # final windows per step on the CPU (see max_finals)


@dataclass
class EngineConfig:
    # -- windows
    # None: every window is padded to 30 s (Whisper's input); else to a multiple of this many
    # seconds (faster, slightly worse text: docs/architecture.md)
    pad_seconds: int | None = None
    # with endpointing, a partial that cannot commit yet (under agree_after_ms of audio since
    # the last final) decodes only that audio, padded to a multiple of this: a preview,
    # shown and never committed. None: partials decode the whole window, padded as finals
    preview_pad_seconds: int | None = 10
    # -- endpointing and commits
    endpoint_ms: int | None = 250  # silence after speech that makes the window final (None: off)
    # an item is speech when Silero VAD gives one of its 32 ms chunks this probability (or,
    # right after speech, this less 0.15): level-independent, and no words from noise
    vad_threshold: float = 0.5
    agree_after_ms: int = 8000  # with endpointing: agreement commits only past this much audio
    # tokens of committed words a window's prompt holds at most (a sentence or two): a live
    # final's window already holds its last sentence, given; more text before it makes the
    # decoder read the next sentence's first words from the text more than from the speech
    # (docs/evaluation.md, The prompt and the sentences' first words)
    prompt_tokens: int = 40
    # beams of a decode committed whole (a final, a file's window: engine.model.beam), or of a
    # partial whose words agreement may commit, after its greedy decode (its preview's tokens
    # verified as a draft in a call or two); other partials stay greedy. A search takes a
    # decoder call per token: it runs only while the engine has headroom (engine/load.py), in
    # a step with at most one live final and no other live final due, and gives way to one
    # that falls due (the greedy decode stays). 1: greedy only
    beam_size: int = 5
    # -- scheduling
    decode_interval_ms: int = 1000  # new audio between two partial decodes of a session
    decode_only_speech: bool = True  # no decode of a window, or partial, without new speech
    max_num_seqs: int = 16  # windows decoded per step
    max_partials: int = 16  # partial windows per step
    # final windows per step; None: 2 on the CPU, where a batch of windows costs the sum of
    # their encoder passes and the first final would wait for the last, else max_num_seqs
    max_finals: int | None = None
    finals_alone: bool = True  # a step with a final takes no partials
    encoder_budget_s: float = 60.0  # new audio encoded per step
    encoder_cache_s: float = 3840.0  # audio whose encoder inputs the cache holds
    # -- items and caches
    item_samples: int = ITEM_SAMPLES  # 1280: 80 ms audio items
    processor_cache_mb: int = 64  # processed features (log-mel) kept by content hash
    # run the model in a worker process (engine/worker.py), out of the caller's interpreter
    # lock (`voxtide serve` does); False: in the calling process (tests, scripts)
    worker_process: bool = False
    # the encoder's linear layers on int8 weights (CPU; Whisper.set_encoder_int8), applied
    # when the model loads; None: where the CPU has no native bf16, which int8 outruns there
    # at the same WER (docs/performance.md, docs/evaluation.md)
    int8: bool | None = None

    def __post_init__(self) -> None:
        for name in ("pad_seconds", "preview_pad_seconds"):
            seconds = getattr(self, name)
            if seconds is not None and not 1 <= seconds <= 30:
                raise ValueError(f"{name} must be 1-30 seconds (or None), got {seconds}")
        if self.endpoint_ms is not None and not 80 <= self.endpoint_ms <= 10_000:
            raise ValueError(f"endpoint_ms must be 80-10000 (or None: off), got {self.endpoint_ms}")
        for name in ("max_num_seqs", "max_partials", "max_finals"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (windows per step), got {value}")
        if not 20 <= self.decode_interval_ms <= 10_000:
            raise ValueError(f"decode_interval_ms must be 20-10000, got {self.decode_interval_ms}")
        for name in ("encoder_budget_s", "encoder_cache_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 second, got {getattr(self, name)}")
        check_beam_size(self.beam_size)
        if not 0 <= self.prompt_tokens <= MAX_PROMPT_TOKENS:
            raise ValueError(f"prompt_tokens must be 0-{MAX_PROMPT_TOKENS}, got {self.prompt_tokens}")
        if not 0.0 < self.vad_threshold < 1.0:
            raise ValueError(f"vad_threshold must be between 0 and 1, got {self.vad_threshold}")
        item_positions(self.item_samples)  # a whole number of positions, or ValueError

    @property
    def agree_after(self) -> int:
        """Audio (ms) that waits uncommitted before agreement commits: with endpointing,
        pauses commit and agreement only long unbroken speech."""
        return self.agree_after_ms if self.endpoint_ms is not None else 0

    @property
    def previews(self) -> bool:
        return self.endpoint_ms is not None and self.preview_pad_seconds is not None

    def scheduler_config(self, device_type: str) -> SchedulerConfig:
        """The scheduler's settings, in positions, for a model on `device_type`."""
        max_finals = self.max_finals
        if max_finals is None and device_type == "cpu":
            max_finals = CPU_MAX_FINALS
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_partials=self.max_partials,
            encoder_budget=seconds_to_positions(self.encoder_budget_s),
            encoder_cache_size=seconds_to_positions(self.encoder_cache_s),
            decode_interval=ms_to_positions(self.decode_interval_ms),
            decode_only_speech=self.decode_only_speech,
            preview_positions=ms_to_positions(self.agree_after_ms) if self.previews else 0,
            finals_alone=self.finals_alone, max_finals=max_finals)
