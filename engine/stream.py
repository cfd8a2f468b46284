"""One session's engine state, and its one owner: `Stream`.

A stream cuts the session's audio into items on its timeline (the `Request` the scheduler
reads), hashes them, tracks speech and pauses, keeps the commit policy, the drafts and the
map of the silence flushes inserted; and its commit step applies a decode's result. The
engine keeps a dict of streams: dropping a session is one deletion (and the release of its
encoder-cache entries, which the cache owns).

Besides the scheduler's bookkeeping of what it scheduled, only the commit step (`apply`)
and the client's commands (add_audio, flush, finish) change a stream.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from audio.frames import CONTEXT_BEFORE, AudioFramer, LogFloor, brought_up, item_levels
from audio.pauses import PauseTracker
from audio.vad import (
    CHUNK_SAMPLES,
    SpeechDetector,
    TurnDetector,
    TurnSettings,
    VadEvent,
    heard,
    item_chunks,
    level_db,
)
from engine import commit
from engine.config import EngineConfig
from engine.model_runner import WindowResult
from engine.policy import LocalAgreement, PolicyUpdate
from engine.request import MMFeature, PlaceholderRange, Request, RequestStatus
from engine.scheduler import ScheduledWindow
from engine.speech_map import (
    LEAD_IN_MS,
    LONG_SILENCE_MS,
    UNHEARD_SPEECH_MS,
    SpeechMap,
)
from engine.timeline import (
    item_positions,
    ms_to_positions,
    positions_to_ms,
    positions_to_samples,
    samples_to_ms,
)
from engine.words import Word, mean_logprob, shift_timestamps, timed_prompt

# speech within this of the committed words' end is taken for their tail (a last word's
# aligned end may fall short of its sound)
SPEECH_TAIL_MS = 500
# a word read again lies this close to where a decode before read it, and the word after it
# starts no more than ALIGN_SLACK_MS before its end there
REREAD_SLACK_MS = 600
ALIGN_SLACK_MS = 100


@dataclass
class EngineOutput:
    request_id: str
    committed: list[Word]  # newly committed words (final, never rewritten)
    tentative: list[Word]  # current tentative tail (replaces the previous one)
    finished: bool = False  # the request is done; no more outputs
    flushed_ms: int | None = None  # set when a flush completed: all audio before it is committed
    error: str | None = None
    done_ms: int = 0  # no later output has words before this (received-audio ms)
    # speech started / stopped (received-audio ms), for a session that asked (Engine.set_turns);
    # an output with these carries nothing else (Engine.take_turns)
    turns: list[VadEvent] = field(default_factory=list)

    @property
    def flushed(self) -> bool:
        return self.flushed_ms is not None


def _read_again(word: Word, before: Word) -> bool:
    """Whether `word` of a decode is `before`, a word a decode before read, read again at its
    place (`REREAD_SLACK_MS`)."""
    return word.key == before.key and abs(word.end_ms - before.end_ms) < REREAD_SLACK_MS


def hash_key(model_id: str, item_samples: int) -> bytes:
    """The key of item content hashes: an item's features depend on these too."""
    params = f"{model_id}:{item_samples}"
    return hashlib.blake2b(params.encode(), digest_size=16).digest()


def hear(streams: list[Stream], probs: list[np.ndarray]) -> None:
    """Each stream's VAD probabilities of the chunks its taken samples completed: make the
    items they cover and track their speech, the levels of all streams' new items from one
    log-mel (`item_levels`)."""
    ready = [stream.listen(p) for stream, p in zip(streams, probs, strict=True)]
    contexts = [context for items in ready for context, _ in items]
    levels = item_levels(contexts, streams[0].floor.n_mels) if contexts else []
    at = 0
    for stream, items in zip(streams, ready, strict=True):
        stream.add_items(items, levels[at : at + len(items)])
        at += len(items)


def item_hash(context: np.ndarray, floor: float, key: bytes) -> str:
    """An audio item's content hash: its PCM with context (audio/frames.py) and its log-mel
    floor, keyed."""
    h = hashlib.blake2b(context.tobytes(), key=key, digest_size=16)
    h.update(f"{floor:.2f}".encode())
    return h.hexdigest()


class PaddingMap:
    """Silence that flushes inserted into the timeline, to give times in received audio."""

    def __init__(self) -> None:
        self.ends: list[int] = []  # timeline ms where each padding ends
        self.totals: list[int] = []  # padding ms up to there

    def add(self, timeline_end_ms: int, total_ms: int) -> None:
        self.ends.append(timeline_end_ms)
        self.totals.append(total_ms)

    def audio_ms(self, timeline_ms: int) -> int:
        """Session timeline ms -> ms of received audio (inside a padding: its start)."""
        ends = self.ends
        if not ends:
            return timeline_ms
        i = bisect.bisect_right(ends, timeline_ms)  # paddings 0..i-1 end before timeline_ms
        before = self.totals[i - 1] if i else 0
        if i < len(ends):  # inside padding i: clamp to its start
            timeline_ms = min(timeline_ms, ends[i] - (self.totals[i] - before))
        return timeline_ms - before

    def audio_words(self, words: list[Word]) -> list[Word]:
        if not self.ends:
            return words
        f = self.audio_ms
        return [replace(w, start_ms=f(w.start_ms), end_ms=f(w.end_ms)) for w in words]


class Stream:
    def __init__(self, request_id: str, config: EngineConfig, key: bytes, timestamp_begin: int,
                 n_mels: int = 80, background: bool = False, full_stop: int | None = None):
        self.config = config
        self.request = Request(request_id, background=background)
        self.framer = AudioFramer(config.item_samples)
        self.floor = LogFloor(n_mels)
        self.contexts: deque[np.ndarray] = deque()  # framed items waiting for the VAD (see hear)
        self.vad = SpeechDetector()  # fed the timeline's samples, padding included
        self.unheard: list[np.ndarray] = []  # samples added since the VAD last ran (Engine.hear)
        self.speech_probs: deque[float] = deque()  # VAD chunks from `first_chunk` on
        self.first_chunk = 0
        self.in_speech = False  # the last item tracked was speech
        self.num_flushed = 0  # items before the last flush: made without waiting for a chunk
        self.speech = SpeechMap(config.vad_threshold)
        self.turns: TurnDetector | None = None  # the session's turn events, if it asked
        self.turn_events: list[VadEvent] = []  # found by the VAD, not taken yet
        self.policy = LocalAgreement()
        self.padding = PaddingMap()
        # window start -> (window end, tokens) of the last decode from there: the draft of the
        # next decode of a window with that start (the window's and the preview's, at most two)
        self.drafts: dict[int, tuple[int, list[int]]] = {}
        # (window start, number of tokens): a window cut to keep the last sentence a final
        # committed reads that sentence's text as given (`forced`), its audio as context
        self.kept: tuple[int, int] | None = None
        self.split = (-1, 0)  # (window start, end) of the last final ended early at skipped speech
        # a live final's new words read unsure after context, or copying it: (window end, the
        # words, their reading as commit.surer weighs it), until the final read again without
        # it (`request.reread_start`, commit.doubted, commit.copied_words)
        self.doubt: tuple[int, list[Word], commit.Reading] | None = None
        # (the end, the words) of a live final read unsure with no context before it, whose
        # words wait uncommitted for the next final of the window (commit.held)
        self.held: tuple[int, list[Word]] | None = None
        # the last word of the last live final, committed or held: the next final reads the
        # pause after it, on or to a sentence's end (`commit.PauseHabit`)
        self.pause_word: Word | None = None
        self.habit = commit.PauseHabit()
        # the window starts where the session does or after a long silence (`skip_silence`),
        # not where a commit cut it: no speech comes before it
        self.fresh_window = True
        self.key = key
        self.timestamp_begin = timestamp_begin
        self.full_stop = full_stop  # the token a prompt reads after a live final (`LocalAgreement.close`)
        self.item_positions = item_positions(config.item_samples)  # 4 for 80 ms
        endpoint_ms = config.endpoint_ms
        if background and endpoint_ms is not None:
            # a file's audio is there before its decode: no final waits for a pause, and its
            # windows end at long silences only, as offline `transcribe`'s; between them they
            # run 30 s and seek, and each utterance is read with the speech after it
            endpoint_ms = max(endpoint_ms, LONG_SILENCE_MS)
        # a live talker's pauses include quieter stretches under other voices; a file's long
        # silences are the VAD's
        self.pauses: PauseTracker | None = None
        if endpoint_ms is not None:
            self.pauses = PauseTracker(samples_to_ms(config.item_samples), self._items(endpoint_ms),
                                       not background)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def committed_ms(self) -> int:
        """End of the committed text in received-audio ms."""
        return self.padding.audio_ms(self.policy.committed_end_ms)

    @property
    def looked_at_samples(self) -> int:
        """Timeline samples up to the last decoded window's end or, when the VAD heard only
        silence since then, up to the last item it heard: a silent session has no backlog
        (nothing there is decoded, ever)."""
        request = self.request
        end = request.num_decoded_positions
        if request.last_speech_end <= end:
            end = max(end, request.num_positions)
        return positions_to_samples(end)

    # ------------------------------------------------------------------ commands

    def add_audio(self, samples: np.ndarray) -> None:
        """Append (n,) float32 16 kHz samples."""
        if self.request.input_finished:
            raise ValueError(f"request {self.request_id!r} is finished; no more audio")
        samples = np.asarray(samples, np.float32)
        self.unheard.append(samples)
        self.contexts.extend(self.framer.push(samples))

    def flush(self) -> None:
        """Decode and commit everything received so far (the session stays open)."""
        if not self.request.input_finished:  # else finishing commits everything anyway
            self._flush_framer()
            self.request.flush_position = max(self.framer.num_items * self.item_positions, 1)

    def finish(self) -> None:
        """No more audio: commit everything, then end."""
        if not self.request.input_finished:
            self._flush_framer()
            self.request.input_finished = True

    def _flush_framer(self) -> None:
        framer = self.framer
        padding = -framer.num_samples % framer.item_samples  # what flush() adds
        self.unheard.append(np.zeros(padding, np.float32))
        self.contexts.extend(framer.flush())
        self.num_flushed = framer.num_items
        if padding:
            self.padding.add(samples_to_ms(framer.num_samples), samples_to_ms(framer.num_padded))

    def set_endpoint(self, endpoint_ms: int) -> None:
        """The session's own endpoint: a pause of `endpoint_ms` (in whole items, as the
        server's) ends an utterance from now on, never a shorter one than the server's
        (`EngineConfig.endpoint_ms`). A talker who stops to think mid-sentence gets a final
        there, and the rest of the sentence is read as a new one; a client that expects such
        pauses asks for a longer endpoint, at the cost of its finals' latency. A file's
        windows, and a server without endpointing, are left as they are."""
        if self.pauses is None or self.request.background:
            return
        self.pauses.set_endpoint(self._items(max(endpoint_ms, self.config.endpoint_ms or 0)))

    def _items(self, ms: int) -> int:
        """A pause of `ms` in whole items (the setting rounded down to 20 ms, then up)."""
        return -(-ms_to_positions(ms) // self.item_positions)

    def set_turns(self, settings: TurnSettings | None) -> None:
        """Find speech started / stopped events in the audio from now on (None: stop)."""
        self.turns = TurnDetector(settings) if settings is not None else None

    # ------------------------------------------------------------------ speech

    def take_unheard(self) -> np.ndarray:
        """The samples added since the VAD last ran, for Engine.hear."""
        samples = np.concatenate(self.unheard) if len(self.unheard) != 1 else self.unheard[0]
        self.unheard = []
        return samples

    def hear(self, probs: np.ndarray) -> None:
        """The VAD's probabilities of the chunks the taken samples completed: make the items
        they cover and track their speech (`hear`, for this stream alone)."""
        hear([self], [probs])

    def listen(self, probs: np.ndarray) -> list[tuple[np.ndarray, bool]]:
        """The VAD's probabilities of the chunks the taken samples completed -> the items
        they complete: (PCM context, whether the VAD heard speech in it). An item waits for
        the chunk across its end (so the decision does not depend on how the audio arrived),
        except before a flush, where none follows."""
        self.speech_probs.extend(probs)
        self.speech.push(probs)
        if self.turns is not None:
            first = self.vad.num_chunks - len(probs)
            events = self.turns.push(probs, self.vad.chunk_levels, first)
            self.turn_events += [VadEvent(e.kind, self.padding.audio_ms(e.ms)) for e in events]
        size = self.config.item_samples
        analysed = self.vad.num_chunks * CHUNK_SAMPLES
        ready = []
        while self.contexts:
            item = self.request.num_items + len(ready)
            end = (item + 1) * size
            if -(-end // CHUNK_SAMPLES) * CHUNK_SAMPLES > analysed and item >= self.num_flushed:
                break
            ready.append((self.contexts.popleft(), self._is_speech(item)))
        return ready

    def add_items(self, ready: list[tuple[np.ndarray, bool]], levels: list[float]) -> None:
        """`listen`'s items and their loudest levels (`item_levels`) -> items on the timeline,
        each brought up by its gain, with its log-mel floor (both depend on the VAD's decision,
        LogFloor); track their speech."""
        request, size = self.request, self.config.item_samples
        for (context, speech), level in zip(ready, levels, strict=True):
            item = request.num_items
            gain, floor = self.floor.push(level, speech)
            heard = brought_up(context, gain)
            request.mm_features.append(MMFeature(item_hash(heard, floor, self.key),
                                                 PlaceholderRange(request.num_positions, self.item_positions),
                                                 (heard, floor)))
            samples = context[CONTEXT_BEFORE : CONTEXT_BEFORE + size]
            self._track_speech(item, speech, float(level_db(samples - samples.mean())))

    def _is_speech(self, item: int) -> bool:
        """Whether the VAD heard speech in the item: a chunk over it at or above the threshold,
        or, right after speech, at or above the threshold less Silero's hysteresis. (The last
        chunk of an item, when a flush padded it, may not be analysed yet: it counts for the
        next one.)"""
        end = (item + 1) * self.config.item_samples
        probs = self.speech_probs
        first, last = item_chunks(item, self.config.item_samples)
        lo, hi = max(first - self.first_chunk, 0), min(last - self.first_chunk, len(probs))
        across = [probs[j] for j in range(lo, hi)]
        while probs and (self.first_chunk + 1) * CHUNK_SAMPLES <= end:  # chunks before the next item
            probs.popleft()
            self.first_chunk += 1
        self.in_speech = heard(across, self.in_speech, self.config.vad_threshold)
        return self.in_speech

    def _track_speech(self, item: int, speech: bool, level: float) -> None:
        """After an item (the VAD's decision, its level in dBFS): note where speech last was
        (the scheduler decodes no silence), and mark an endpoint once `endpoint_ms` of the
        talker's pause follow its speech (since the last endpoint; audio/pauses.py). The
        window that reaches it ends there and is final: committed whole, one decode of a
        complete utterance with no agreement to wait for."""
        request = self.request
        end = (item + 1) * self.item_positions
        if speech:
            request.last_speech_end = end
        held = self.held[0] if self.held is not None else None
        if held is not None and request.last_speech_end <= held and not request.endpoints \
                and end - held >= ms_to_positions(commit.HOLD_SILENCE_MS):
            request.endpoints.append(end)  # no next utterance came: the held words' final
            request.last_endpoint = end
        if self.pauses is None:
            return
        if self.pauses.push(speech, level) and self.pauses.ends_utterance:
            voice_end = end - self.pauses.pause_items * self.item_positions  # where the pause began
            if voice_end > max(request.last_endpoint, request.window_start):
                request.endpoints.append(end)
                request.last_endpoint = end

    def skip_silence(self) -> None:
        """Start the window shortly before speech that follows a long silence, once
        everything before that silence is read. Whisper, given seconds of silence before
        the speech (and the committed text as its prompt), repeats the prompt's last sentence
        or makes up words in them; the silence holds nothing to transcribe. Not while a decode
        of the window is in flight (its result is applied against the window it had)."""
        request = self.request
        if request.output_token_ids and request.output_token_ids[-1] == -1:
            return
        if request.flush_position:  # a flush's final ends at it: it comes first
            return
        committed = self.policy.committed_end_ms
        start = max(positions_to_ms(request.window_start), committed)
        # read: committed, or read by a final as nothing (a knock, a note of music that the
        # VAD took for speech); a held final leaves `preview_start` where it was
        read = max(committed, positions_to_ms(request.preview_start))
        onset = self.speech.next_speech(max(start, read) + SPEECH_TAIL_MS)
        if onset is None or onset - start < LONG_SILENCE_MS:
            return
        if self.speech.speech_ms(read + SPEECH_TAIL_MS, onset) == 0:
            self._cut(ms_to_positions(onset - LEAD_IN_MS))
            self.fresh_window = True

    # ------------------------------------------------------------------ decoding

    def draft(self, start: int, preview: bool) -> list[int]:
        """The tokens a decode of the window from `start` is likely to give: the last decode
        from there (its timestamps line up), followed, for a window that starts before the
        last final's end, by the newer preview of the audio since then, its timestamps moved
        to this window's. Verified by the decoder, so a wrong guess costs time, not text."""
        preview_start = self.request.preview_start
        end, tokens = self.drafts.get(start, (start, []))
        if preview or preview_start <= start:
            return tokens
        preview_end, preview_tokens = self.drafts.get(preview_start, (0, []))
        if preview_end <= end:
            return tokens  # no preview since that decode
        return tokens + shift_timestamps(preview_tokens, preview_start - start, self.timestamp_begin)

    def forced(self, start: int, preview: bool) -> int:
        """How many of the draft's first tokens a decode of the window from `start` takes as
        given: those of the sentence the window keeps as context (`kept`). It is committed, and
        read again it costs decoder calls wherever the reading differs (the tail of the word
        before, read as a word; timestamps placed otherwise) for nothing it would commit."""
        if preview or self.kept is None or self.kept[0] != start:
            return 0
        return self.kept[1]

    def heard_speech(self, window: ScheduledWindow) -> bool:
        """Whether the VAD heard speech in a window past its committed words (its decode is
        then no silence, whatever Whisper's no-speech probability says)."""
        start = max(positions_to_ms(window.window_start), self.policy.committed_end_ms)
        return self.speech.heard(start, positions_to_ms(window.window_end))

    def may_commit(self, window: ScheduledWindow) -> bool:
        """Whether the decode of a window the scheduler gave can commit words."""
        return commit.may_commit(window.preview, window.commits_whole, self._pending_ms(window.window_end),
                                 self.config.agree_after)

    def keep_prefix(self, tokens: list[int], preview: bool) -> None:
        """The tokens a given-up partial had decoded are the start of its window's greedy
        decode: where longer than that window's draft, they are its new draft (they cover
        newer audio: under load the draft of a final late in a burst missed its last words)."""
        request = self.request
        start = request.preview_start if preview else request.window_start
        _, draft = self.drafts.get(start, (start, []))
        if len(tokens) > len(draft):
            self.drafts[start] = (request.num_decoded_positions, tokens)

    def _prune_drafts(self) -> None:
        """Keep the drafts of windows that can still be decoded: the window's and the preview's."""
        keep = (self.request.window_start, self.request.preview_start)
        for start in [s for s in self.drafts if s not in keep]:
            del self.drafts[start]
        if self.kept is not None and self.kept[0] != self.request.window_start:
            self.kept = None

    # ------------------------------------------------------------------ the commit step

    def fail(self, error: str) -> EngineOutput:
        self.request.status, self.request.error = RequestStatus.ERROR, error
        return EngineOutput(self.request_id, [], [], finished=True, error=error)

    def apply(self, result: WindowResult) -> EngineOutput:
        """Apply the decode of the window the scheduler gave: commit what the rules say, cut
        the window, keep the tokens as the next decode's draft."""
        request, policy = self.request, self.policy
        facts = self._facts(result)
        # a second reading (`self.doubt`) decoded from the last final's end, not the window's start
        reread = result.final and self.doubt is not None
        self._decoded(result, request.preview_start if reread else facts.start, facts.end)
        interval = ms_to_positions(self.config.decode_interval_ms)
        plan = commit.plan(facts, interval, self.config.agree_after)
        words = self.speech.fit(result.words, floor_ms=positions_to_ms(facts.start))
        # a live final's window ends at the utterance's pause (a stretch it skips is retried
        # from the committed end, `commit.new_window_start`); a file's runs to a long silence
        if plan.action is commit.Action.WHOLE or (plan.action is commit.Action.FINAL and request.background):
            facts, words, skipped = self._unskipped(facts, words)
            if skipped:  # a final to the pause after the skipped speech comes next
                plan = commit.Plan(commit.Action.AGREE)
            elif plan.action is commit.Action.WHOLE:
                plan = commit.plan(facts, interval, self.config.agree_after)
        final = plan.action is commit.Action.FINAL
        if (plan.action is commit.Action.AGREE and plan.counts) or (final and not request.background):
            words = self._before_skip(facts, words)
        if not (result.preview or reread or result.temperature):  # a greedy reading is the prompts'
            policy.read_window(words)
        # a final that passed over the window's committed words commits nothing: it is
        # decoded again from their end (`commit.retries`); so is one whose new words it read
        # unsure after them or that copy them, and the surer reading is committed (`commit.surer`)
        passed_over = final and not reread and not policy.rereads(words)
        live_final = final and not request.background
        new = policy.new_words(words, self._reread_ms() if reread else None) if live_final else []
        sureness, copied = mean_logprob(new), commit.copied_words([w.key for w in words], len(new))
        may_retry = commit.may_retry(facts, ms_to_positions(policy.committed_end_ms))
        # the final after a hold read the held words with the speech after them: no second reading
        doubt = not reread and not passed_over and may_retry and self.held is None and self._drops_context() \
            and (commit.doubted(sureness, len(new)) or copied > 0)
        unsure = live_final and self.fresh_window and self.held is None and commit.held(
            facts, ms_to_positions(policy.committed_end_ms), sureness, len(new))
        redo = passed_over and may_retry
        # where the speech after the last final's pause starts, if this final reads it ended a sentence
        ended = self._read_pause(words, facts) if live_final and not (reread or passed_over) else None
        # held words are done where no speech came after them, or this final read none of seconds of it
        last_word = self.held is not None and request.last_speech_end <= self.held[0]
        moved = live_final and not (reread or passed_over or last_word) and self._done_with_hold(facts, words)
        ended = ended if self.held is not None else None  # (only held words wait to be done)
        new = self._reading(facts, new, reread, sureness, copied)
        # the held words before a pause read as a sentence's end are done
        done = 0 if ended is None or last_word else sum(w.start_ms < ended for w in new)
        # a reading that stops inside a sentence waits for the rest of it (a hold's release too),
        # as every reading of a talker who pauses inside sentences does
        hold = unsure or (live_final and not (doubt or redo or last_word or moved) and done < len(new)
                          and commit.unfinished(facts, new[-1].ends_open or self.habit.inside_sentences))
        if doubt:  # read again from the last final's end, the window kept for the finals after
            self.doubt = (facts.end, new, (sureness, [w.key for w in new], copied, facts.failed))
            request.reread_start = request.preview_start
            update = PolicyUpdate([], new)  # shown until the second reading
        elif hold:  # read again with the next utterance, from the window's start
            update = PolicyUpdate(self._commit(plan, new[:done], new=True, timed=result.timed).committed
                                  if done else [], new[done:])
            new = new[done:]
        else:
            # a live final commits its new words, found once (`new_words`)
            update = PolicyUpdate([], []) if redo else self._commit(
                plan, new if live_final else words, new=live_final, timed=result.timed)
        end_ms = policy.committed_end_ms
        # a final's speech past the committed words went unheard (`commit.retries`)
        missed = self._unread(end_ms, facts.end) if final else commit.NOTHING_UNREAD
        sentence = self._sentence_start_ms(live_final)
        cut = None if doubt or hold else commit.new_window_start(
            facts, plan.action, ms_to_positions(end_ms), missed,
            None if sentence is None else ms_to_positions(sentence), redo, policy.ends_inside_phrase)
        # a final's retry is cut at its committed end; one that keeps its last sentence is done
        retrying = final and commit.retries(facts, ms_to_positions(end_ms), missed, redo)
        cut = self._retry_start(end_ms) if retrying and cut is not None else cut
        if cut is not None:
            self._cut(cut)
            self.fresh_window = False
        retry = final and (doubt or (retrying and cut is not None and cut < facts.next_start))
        if live_final and (hold or update.committed):
            self.pause_word = (new if hold else update.committed)[-1]
        return self._output(result, facts, update, new if hold else None, final and not retry)

    def _output(self, result: WindowResult, facts: commit.WindowFacts, update: PolicyUpdate,
                held: list[Word] | None, final_done: bool) -> EngineOutput:
        """What a decode leaves once its words are committed: a hot decode's text, its own
        included, in no later prompt (as Whisper's rule: prompted with a "Thank you." sampled
        over babble, the retries after it read "Thank you." again); the words it holds, or the
        end of a final that is done (not a retry's: that final stays due); its output."""
        request = self.request
        if result.temperature > 0.5:
            self.policy.reset_prompt()
        flushed_ms, done = None, False
        if held is not None:
            self._hold(facts.end, held)
        elif final_done:
            self._after_final(facts)
            if facts.flushed:
                flushed_ms = self.padding.audio_ms(positions_to_ms(facts.end))
            done = request.input_finished and request.window_start >= request.num_positions
            if done:
                request.status = RequestStatus.FINISHED
        return EngineOutput(self.request_id, self.padding.audio_words(update.committed),
                            self.padding.audio_words(update.tentative), finished=done,
                            flushed_ms=flushed_ms,
                            done_ms=self.padding.audio_ms(positions_to_ms(request.window_start)))

    def _decoded(self, result: WindowResult, start: int, end: int) -> None:
        """What every decode (from `start` to `end`) leaves: its tokens, the next decode's
        draft; a final, no second reading pending."""
        self.drafts[start] = (end, result.tokens)
        if result.final:
            self.request.reread_start = None

    def _facts(self, result: WindowResult) -> commit.WindowFacts:
        """What the commit rules need of the window a result decoded (the scheduler noted its
        end; only the commit step moves its start)."""
        request = self.request
        start = request.preview_start if result.preview else request.window_start
        end = request.num_decoded_positions
        flushed = result.final and ((request.input_finished and end == request.num_positions)
                                    or 0 < request.flush_position <= end)
        complete = ms_to_positions(result.complete_ms) if result.complete_ms is not None else None
        resume = None
        if result.final and not (flushed or request.background):
            size = self.item_positions  # (a cut starts on an item: rounded up, into the pause)
            after = -(-ms_to_positions(self.speech.after_pause(positions_to_ms(end))) // size) * size
            resume = max(start, min(after, end))
        return commit.WindowFacts(start, end, result.final, result.preview, flushed, result.silence,
                                  complete, self._pending_ms(end), result.failed, resume,
                                  result.given_logprob,
                                  result.final or result.preview or self.policy.rereads(result.words))

    def _pending_ms(self, end: int) -> int:
        """Audio that waits uncommitted up to `end` (positions), for agreement's bound
        (`agree_after_ms`): past the committed words, or past a held final's pause. Held words
        wait for the next final, which reads them with the next utterance whole; partials
        with only its first seconds read them as the held final did and would agree on that
        reading (docs/architecture.md, Commit policy)."""
        since = self.policy.committed_end_ms
        if self.held is not None:
            since = max(since, positions_to_ms(self.held[0]))
        return positions_to_ms(end) - since

    def _unskipped(self, facts: commit.WindowFacts,
                   words: list[Word]) -> tuple[commit.WindowFacts, list[Word], bool]:
        """A decode committed whole (a final, or up to its last complete segment), made not to
        pass over speech, as offline `transcribe`'s `_mind_the_gap` -> (its facts, the words
        that count, whether none do). Where the VAD heard seconds of speech past the committed
        words that no word covers (the decoder skipped a sentence, often one that repeats the
        prompt's), a full window keeps the words before it and goes on from there; a file's
        final, or a window that skipped from its start, keeps none, and a final to the first
        pause after seconds of that speech is due next (once per window start and pause),
        which reads that audio cut short. A full window then starts before speech that begins
        after its last word kept (a late segment end cuts off its onset), or at that word's end
        where its decode stopped reading run-on speech (`SpeechMap.resume_at`)."""
        speech = self.speech
        end_ms = positions_to_ms(facts.end if facts.final else facts.complete or 0)
        hole = self._skipped(facts, end_ms, words)
        if hole is not None:
            kept = [w for w in words if w.end_ms <= hole[0]]
            if not kept or facts.final:
                skip_end = speech.skip_end(hole)
                end = ms_to_positions(skip_end) if skip_end is not None else 0
                endpoints = self.request.endpoints
                again = self.split[0] == facts.start and end <= self.split[1]
                if again or not facts.start < end < (endpoints[0] if endpoints else facts.end):
                    return facts, words, False  # no pause to end it at, or read so already: as decoded
                endpoints.appendleft(end)
                self.split = (facts.start, end)
                return facts, [], True
            words, end_ms = kept, kept[-1].end_ms
        if facts.final:
            return facts, words, False
        resume = speech.resume_at(words[-1].end_ms, end_ms, positions_to_ms(facts.end)) if words else None
        if resume is not None:
            end_ms = resume
        return replace(facts, complete=max(ms_to_positions(end_ms), facts.start + 1)), words, False

    def _unread(self, end_ms: int, end: int) -> commit.Unread:
        """The VAD speech a final's window (to `end`, positions) holds past its committed end."""
        return commit.Unread(*self.speech.unread(end_ms, positions_to_ms(end)))

    def _retry_start(self, end_ms: int) -> int:
        """Where a retrying final's window starts (positions; `commit.new_window_start` cuts it
        at the committed end, `end_ms`): past the last word's sound (`SpeechMap.past_tail`: the
        alignment ends a last word early, and a window that opens on its tail reads it as a
        word)."""
        return ms_to_positions(self.speech.past_tail(end_ms, SPEECH_TAIL_MS))

    def _sentence_start_ms(self, live_final: bool) -> int | None:
        """Where a window cut may keep the committed words from: their unfinished sentence's
        start, or for a live final's cut their last sentence's (`commit.KEEP_SENTENCE_POSITIONS`;
        not at the stream's end, whose last final ends it)."""
        if live_final and not self.request.input_finished:
            keep_ms = positions_to_ms(commit.KEEP_SENTENCE_POSITIONS)
            return self.policy.sentence_start_ms(keep_ms, finished=True)
        return self.policy.sentence_start_ms(positions_to_ms(commit.SENTENCE_CUT_POSITIONS))

    def _reread_ms(self) -> int:
        """Where a final's second reading (`self.doubt`) starts: the last final's end (ms)."""
        return positions_to_ms(self.request.preview_start)

    def _drops_context(self) -> bool:
        """Whether a second reading reads without context: committed words of the window lie
        before its start. (In a window with no final since its start, partials committed the
        first words of a long utterance: a second reading would be the first again.)"""
        policy = self.policy
        return policy.num_reread(self._reread_ms()) < policy.num_window_committed

    def _read_pause(self, words: list[Word], facts: commit.WindowFacts) -> int | None:
        """A live final's decode of its window, `words`, reads the last final's pause
        (`pause_word`'s end) on or to a sentence's end, where words follow it: the talker's
        habit (where the decode was given the sentence before the pause, its odds for that
        sentence's mark tell: `facts.given_logprob`). -> where the words after the pause start
        (ms), if read after a sentence's end; else None."""
        word = self.pause_word
        if word is None:
            return None
        after = next((i for i, w in enumerate(words) if w.start_ms >= word.end_ms - ALIGN_SLACK_MS), None)
        if after is None:
            return None
        self.pause_word = None
        if words[after].start_ms - word.end_ms >= LONG_SILENCE_MS:  # a talker who stopped
            return None
        before = next((w for w in reversed(words[:after]) if _read_again(w, word)), None)
        # (a kept sentence taken as given has the mark the final before read)
        given = self.forced(facts.start, preview=False) > 0
        read_on = commit.reads_on(before, words[after], given, facts.given_logprob)
        self.habit.observe(read_on)
        return None if read_on else words[after].start_ms

    def _done_with_hold(self, facts: commit.WindowFacts, words: list[Word]) -> bool:
        """Whether the final after a hold (its decode of the window, `words`) read the held
        words again and ended there, reading none of the seconds of speech the VAD heard after
        them (`commit.done_with_hold`). Held again, that speech would wait for the next
        utterance and be read in a window grown long, after the held words (a far talker after
        a near one: 3 s of quiet speech past the near talker's held sentence, read as "Do it" a
        final later); the held words are done with this reading, and the final is retried from
        their end, as any final that ends before seconds of speech is (`commit.retries`). (No
        speech after them at all: the final is theirs, `_track_speech`.)"""
        if self.held is None or not words:
            return False
        last = words[-1]
        if not _read_again(last, self.held[1][-1]):
            return False  # (it read on past them, or passed over them)
        unread = self._unread(last.end_ms, facts.end)
        return commit.done_with_hold(facts, ms_to_positions(last.end_ms), unread)

    def _reading(self, facts: commit.WindowFacts, new: list[Word], reread: bool, sureness: float | None,
                 copied: int) -> list[Word]:
        """A final's new words -> those it commits or holds: with the held words it read again
        (`_release`; only a live final holds), or the surer of a second reading's two (`_surer`)."""
        if facts.final and self.held is not None:
            new = self._release(facts, new)
        return self._surer(facts, new, sureness, copied) if reread else new

    def _surer(self, facts: commit.WindowFacts, second: list[Word], sureness: float | None,
               copied: int) -> list[Word]:
        """A final read again without its context (`self.doubt`) to `second`, of mean
        log-probability `sureness`, `copied` of its words a copy -> the surer reading's words
        (both start past the committed words), when both read the same audio; the doubt is
        done with either way. (`facts.failed`: Whisper's fallback rule failed the second
        reading's decode at every temperature.)"""
        assert self.doubt is not None
        end, first, reading = self.doubt
        self.doubt = None
        if end != facts.end or not commit.surer(reading, (sureness, [w.key for w in second], copied,
                                                          facts.failed)):
            return second
        return first

    def _before_skip(self, facts: commit.WindowFacts, words: list[Word]) -> list[Word]:
        """The words of a partial's or a live final's decode that may be committed: none past
        seconds of VAD speech after the committed words that no word covers, where words follow
        it (Whisper, reading on from the window's committed words, passed over a sentence:
        under babble two partials that passed over "She said that tomatoes..." agreed on the
        sentence after it). Agreement waits, wherever the skip begins in a window that holds
        committed words (two partials read 8 s of "We ate cold sandwiches ..." from the window's
        start as the one word "wall.", stretched over it, and agreed on it); in one that holds
        none, only if it begins a second or more in (under babble the talker's first word often
        comes seconds into the window). A final is retried from its committed end (`commit.retries`:
        speech past its committed words), if the skip begins a second or more into the window:
        speech a final skipped from the window's start is not read better from the same start,
        and its words are kept as decoded. So is speech at the window's end that no word reads
        yet, but a partial's last word before it: a decode that ends its text seconds of speech
        short of its window's end stopped early, and the word it ended on often took the
        speech after it ("story." for "The storm arrived in the middle of the night...", read
        so by two partials in a row). Its reading of the speech after the word comes later."""
        end_ms = positions_to_ms(facts.end)
        hole = self._skipped(facts, end_ms, words)
        if hole is None:
            return words
        if not facts.final and words and hole == (words[-1].end_ms, end_ms):
            return words[:-1]
        if not commit.may_retry(facts, ms_to_positions(hole[0])) and (
                facts.final or not self.policy.num_window_committed):
            return words
        return [w for w in words if w.end_ms <= hole[0]]

    def _skipped(self, facts: commit.WindowFacts, end_ms: int, words: list[Word]) -> tuple[int, int] | None:
        """Speech a decode of the window passed over: the first stretch between its words,
        past the committed words and up to `end_ms`, in which the VAD heard UNHEARD_SPEECH_MS
        or more (`SpeechMap.unheard`, ms); None: none. `_unskipped` and `_before_skip` are
        the two answers to it."""
        start_ms = max(positions_to_ms(facts.start), self.policy.committed_end_ms)
        return self.speech.unheard(start_ms, end_ms, words, UNHEARD_SPEECH_MS)

    def _commit(self, plan: commit.Plan, words: list[Word], new: bool = False,
                timed: bool = True) -> PolicyUpdate:
        """`new`: a final's words past the committed ones, found (`LocalAgreement.new_words`);
        `timed`: their times are from the audio (`WindowResult.timed`)."""
        policy, action = self.policy, plan.action
        if action is commit.Action.SHOW:
            # only the audio past the committed words: the tentative tail to show. The policy
            # does not see it (no agreement, and a final that finds nothing new does not
            # commit it): a short window alone decodes worse, Whisper's " you" on a breath
            return PolicyUpdate([], words)
        if action is commit.Action.FINAL:
            return PolicyUpdate(policy.flush(words, new).committed, [])
        if not plan.counts:  # a loop: neither agreement nor the tail to show
            update = PolicyUpdate([], list(policy.previous))
        else:
            update = policy.update(words, commit=plan.agree, timed=timed)
        if action is commit.Action.WHOLE:
            return PolicyUpdate(update.committed + policy.flush(words).committed, [])
        if action is commit.Action.FORCE:
            forced = policy.force_commit_until(positions_to_ms(plan.force_until))
            return PolicyUpdate(update.committed + forced.committed, forced.tentative)
        return update

    def _after_final(self, facts: commit.WindowFacts) -> None:
        """A final decode committed everything before its end: its pauses and flush are done;
        what comes after it (previews, a second reading) is read from `facts.next_start`. A
        live final ends at a pause (not at a flush): later prompts read a sentence's end after
        its last word (`LocalAgreement.close`). A window cut to keep the last sentence it
        committed as context has that sentence's words as the opening of its draft, taken as
        given (`forced`): the next final reads on after them."""
        request = self.request
        if not (facts.flushed or request.background) and self.full_stop is not None:
            self.policy.close(self.full_stop)
        self._pass_endpoints(facts.end)
        if request.flush_position <= facts.end:
            request.flush_position = 0
        start = request.window_start
        request.preview_start = max(start, facts.next_start)
        if facts.start < start < request.preview_start:
            kept = self._kept_draft(start)
            self.drafts[start], self.kept = (facts.end, kept), (start, len(kept))
        self._prune_drafts()

    def _kept_draft(self, start: int) -> list[int]:
        """The committed words from `start` on (positions; the window's start) as a decode of
        the window would read them: timed segments, a sentence each (`timed_prompt`)."""
        policy, start_ms = self.policy, positions_to_ms(start)
        window = policy.committed[len(policy.committed) - policy.num_window_committed :]
        kept = [w for w in window if w.start_ms >= start_ms]
        if not kept:
            return []
        tokens = timed_prompt(kept, self.timestamp_begin)
        return shift_timestamps(tokens, ms_to_positions(kept[0].start_ms) - start, self.timestamp_begin)

    def _hold(self, end: int, words: list[Word]) -> None:
        """A final's words wait for the next final (commit.held): its pause is done, and the
        partials until then read the window from its start (previews of all of it)."""
        self._pass_endpoints(end)
        self.held = (end, words)

    def _pass_endpoints(self, position: int) -> None:
        """Drop the pauses at or before `position`: their finals are done or passed."""
        endpoints = self.request.endpoints
        while endpoints and endpoints[0] <= position:
            endpoints.popleft()

    def _release(self, facts: commit.WindowFacts, new: list[Word]) -> list[Word]:
        """The (live) final after a hold, its new words `new` -> the words it commits: those,
        and the held words not committed yet that lie in speech it passed over (all of them
        where it read nothing, or where its words that start before their end spell far fewer
        letters: `commit.skips_held`, and then its words after them). A decode that skips from the
        window's start is not read better from there again (`_before_skip`); the held reading
        is one that read it."""
        assert self.held is not None
        held = [w for w in self.held[1] if w.end_ms > self.policy.committed_end_ms]
        self.held = None
        if not new or not held:
            return held or new
        end_ms = held[-1].end_ms
        if commit.skips_held([w.key for w in held], [w.key for w in new if w.start_ms < end_ms]):
            return held + [w for w in new if w.start_ms >= end_ms and not _read_again(w, held[-1])]
        hole = self._skipped(facts, positions_to_ms(facts.end), new)
        if hole is None:
            return new
        passed = [w for w in held if hole[0] <= w.mid_ms <= hole[1]]
        return sorted(passed + new, key=lambda w: w.start_ms)

    def _cut(self, position: int) -> None:
        """Start the window at `position`, rounded down to an item (never behind the window
        start); the committed words before it leave it, and so do the pauses."""
        request = self.request
        size = self.item_positions
        start = max(request.window_start, min(position, request.num_positions) // size * size)
        request.window_start = start
        self._pass_endpoints(start)
        self.policy.cut_window(positions_to_ms(start))
        self.speech.forget_before(positions_to_ms(start))
        request.preview_start = max(request.preview_start, start)  # committed before
        self._prune_drafts()
