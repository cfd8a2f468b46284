"""Per step: which sessions decode, over which window, and which audio items need encoding.

Torch-free. For each session the window is [window_start, window_end) in encoder positions,
window_start being the last committed boundary; the items in it are found with bisect, and
the items that are new since the last step are found from a per-request pointer, so no step
scans all the items of a session. The scheduler keeps no session of its own: each step it
reads the engine's requests, and it notes on a request what it scheduled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.commit import commits_whole
from engine.encoder_cache import EncoderCacheManager
from engine.load import PARTIAL_SLOWDOWN
from engine.mm_window import get_mm_features_in_window
from engine.request import Request
from engine.timeline import MAX_WINDOW_POSITIONS, POSITIONS_PER_SECOND


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16  # sessions decoded per step
    # partial (tentative) windows per step; final windows come first (see max_finals)
    max_partials: int = 16
    encoder_budget: int = 50 * 60  # new positions encoded per step (60 s of audio)
    encoder_cache_size: int = 50 * 60 * 64  # positions held in the encoder cache
    decode_interval: int = POSITIONS_PER_SECOND  # new positions between two decodes (1 s)
    # no partial decode unless speech came since the last one; no decode of a window without speech
    decode_only_speech: bool = True
    # a partial whose audio since the last final is shorter than this decodes only that
    # audio (a preview, which the engine shows and never commits); 0: partials decode the
    # whole window. The engine sets it to what cannot commit yet (EngineConfig.preview_pad_seconds).
    preview_positions: int = 0
    # a step with a final window takes no partials: a final's latency is its own step's time
    # (plus the step it waited for), not that of a batch of partials behind it; a background
    # file's window then has a step of its own
    finals_alone: bool = True
    # final windows per step (None: up to max_num_seqs). On the CPU a batch of windows costs
    # the sum of their encoder passes, so the first final of a batch waits for the last;
    # the engine sets 2 there (EngineConfig.scheduler_config)
    max_finals: int | None = None


@dataclass
class ScheduledWindow:
    request_id: str
    window_start: int  # first position of the window
    window_end: int  # one past the last position
    item_lo: int  # mm_features[item_lo:item_hi] overlap the window
    item_hi: int
    final: bool  # input finished, or the window reaches the flush position: commit everything
    preview: bool = False  # a partial over only the audio since the last final: shown, never committed
    speech: bool = True  # False: no item in the window was speech (for a final: none since the
    # last final); it is not decoded (Whisper makes " you" of a breath), and commits nothing new
    commits_whole: bool = False  # its decode is committed with no agreement check (engine/commit.py)
    # a background file's window: optional work, given up like a partial for a live final
    background: bool = False

    @property
    def live_final(self) -> bool:
        """A final a live client waits for: its step runs to its end."""
        return self.final and not self.background


@dataclass
class SchedulerOutput:
    windows: list[ScheduledWindow]  # one per session decoded this step
    encoder_inputs: dict[str, list[int]]  # request id -> item indices whose encoder output is new
    num_encoder_positions: int  # positions those items cover (before dedupe)
    freed_mm_hashes: list[str]  # evicted hashes: the runner drops their tensors
    finished_request_ids: list[str] = field(default_factory=list)  # freed since last step


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None):
        self.config = config or SchedulerConfig()
        self.encoder_cache = EncoderCacheManager(self.config.encoder_cache_size)
        self.finished_ids: list[str] = []
        self.num_due = 0  # finals numbered so far (Request.due_number)
        self.num_queued = 0  # round-robin numbers given so far (Request.queue_number)
        self.reencode: dict[str, list[int]] = {}  # request id -> items to encode again (a new runner)
        self.shedding = False  # partials come PARTIAL_SLOWDOWN times less often (engine/load.py)

    def add_request(self, request: Request) -> None:
        """A new session goes to the back of the round-robin."""
        self.num_queued += 1
        request.queue_number = self.num_queued

    def finish_request(self, request: Request) -> None:
        """A request ended (finished, aborted or failed): release its cache entries."""
        self.encoder_cache.free(request.request_id)
        self.reencode.pop(request.request_id, None)
        request.num_freed_items = request.num_encoded_items
        self.finished_ids.append(request.request_id)

    def is_ready(self, request: Request) -> bool:
        if request.output_token_ids and request.output_token_ids[-1] == -1:
            return False  # in flight: its last window's output is still a placeholder
        if self.final_due(request):
            return True  # a final decode is due even when no audio came since the last one
        if self.config.decode_only_speech and request.last_speech_end <= request.num_decoded_positions:
            return False  # only silence since the last decode: nothing to show, nothing to spend
        interval = self.config.decode_interval
        if self.shedding and not request.background:
            interval *= PARTIAL_SLOWDOWN
        return request.num_positions - request.num_decoded_positions >= interval

    def note_final_due(self, request: Request) -> None:
        """Give a request whose final is due its place in line, if it has none; take it from
        one with none due (a cut passed its pause). The engine calls it as audio, flushes and
        ends come in; each schedule calls it for all requests, so every final has a place
        (one the engine did not note: among those that fell due in the last step, in queue
        order)."""
        if not self.final_due(request):
            request.due_number = None
        elif request.due_number is None:
            self.num_due += 1
            request.due_number = self.num_due

    @staticmethod
    def _order(request: Request) -> tuple[bool, bool, int, int]:
        """Sort key: live sessions before background files; finals first, in the order they
        fell due; partials round-robin. (Finals in round-robin order would let a session just
        decoded wait behind finals that fell due after its own, for seconds.)"""
        return (request.background, request.due_number is None, request.due_number or 0,
                request.queue_number)

    @staticmethod
    def final_due(request: Request) -> bool:
        """Input finished, a flush asked for, or a pause ended the speech in the window."""
        return request.input_finished or request.flush_position > 0 or bool(request.endpoints)

    def schedule(self, requests: Iterable[Request]) -> SchedulerOutput:
        """Pick this step's windows among `requests` (the engine's sessions): final windows
        first (they are what a client waits for), oldest first, then partials round-robin,
        then background files. A background window is optional work like a partial: it
        counts against max_partials, and where finals go alone (the CPU) it has a step of
        its own, which the engine loop gives up when a live final falls due."""
        windows: list[ScheduledWindow] = []
        encoder_inputs, self.reencode = self.reencode, {}
        budget = self.config.encoder_budget
        num_positions = num_partials = num_finals = 0
        order = sorted(requests, key=lambda r: r.queue_number)
        for request in order:
            self.note_final_due(request)  # in queue order
        order.sort(key=self._order)
        max_finals = self.config.max_finals or self.config.max_num_seqs
        for request in order:
            if len(windows) >= self.config.max_num_seqs:
                break
            if not self.is_ready(request):
                continue
            partial = not self.final_due(request)
            optional = partial or request.background
            if optional and (num_partials >= self.config.max_partials or (
                    self.config.finals_alone and num_finals)):
                break  # live finals come first in `order`: only optional work is left
            if request.background and windows and self.config.finals_alone:
                break  # a file's window has a step of its own: it delays no live window
            if not optional and num_finals >= max_finals:
                continue  # the next step's (its final stays due, and first in order)
            self.free_behind_window(request)  # (a cut may have skipped items since)
            window = self._window(request, partial)
            new = range(max(request.num_encoded_items, window.item_lo), window.item_hi)
            num_new = sum(request.mm_features[i].mm_position.length for i in new)
            if num_new > budget or not self._allocate(request, new):
                continue  # no room in this step's budget or the cache; later
            budget -= num_new
            num_positions += num_new
            encoder_inputs.setdefault(request.request_id, []).extend(new)
            request.num_encoded_items = window.item_hi
            windows.append(window)
            num_partials += optional
            num_finals += not optional
            if not partial:
                request.due_number = None  # a next final (a pause behind this one) queues anew
            request.num_decoded_positions = window.window_end
            self.num_queued += 1  # decoded now: to the back of the round-robin
            request.queue_number = self.num_queued
        finished, self.finished_ids = self.finished_ids, []
        return SchedulerOutput(windows, encoder_inputs, num_positions,
                               self.encoder_cache.get_freed_mm_hashes(), finished)

    def _window(self, request: Request, partial: bool) -> ScheduledWindow:
        """The window a request decodes now, from its committed boundary (or, for a preview,
        from the last final's end) to its audio's end, a pause or 30 s."""
        start = request.window_start
        end = min(request.num_positions, start + MAX_WINDOW_POSITIONS)
        if request.reread_start is not None and not partial:  # a second reading: no context
            start = request.reread_start
        endpoint = request.endpoints[0] if request.endpoints else 0
        stops = [p for p in (endpoint, request.flush_position) if start < p < end]
        if stops:  # the window ends at the pause or the flush (audio past it waits, a backlog)
            end = min(stops)
        preview = partial and start <= request.preview_start and (
            end - request.preview_start < self.config.preview_positions)
        if preview:
            start = request.preview_start
        lo, hi = get_mm_features_in_window(request.mm_features, start, end)
        # final: the window reaches the end of the input, the flush position or a pause
        # after speech: commit everything. Behind a backlog of over 30 s, they wait.
        final = (request.input_finished and end == request.num_positions) or (
            0 < request.flush_position <= end) or endpoint == end
        # the words before preview_start are committed: a final with no speech after it
        # has nothing to add (the finish after a pause re-decoded the whole utterance)
        heard = max(start, request.preview_start) if final else start
        speech = request.last_speech_end > heard or not self.config.decode_only_speech
        return ScheduledWindow(request.request_id, start, end, lo, hi, final, preview, speech,
                               commits_whole(start, end, final, self.config.decode_interval),
                               request.background)

    def _allocate(self, request: Request, new: range) -> bool:
        """Encoder-cache entries for the items `new`; False (and nothing taken) when the
        cache has no room for them."""
        request_id, features, cache = request.request_id, request.mm_features, self.encoder_cache
        misses = [i for i in new if not cache.check_and_update_cache(request_id, features[i].identifier)]
        # allocate in one go; on failure undo this request's hits and wait
        need = sum(features[i].mm_position.length for i in misses)
        if not cache.can_allocate(need):
            missed = set(misses)
            for i in new:
                if i not in missed:
                    cache.free_encoder_input(request_id, features[i].identifier)
            return False
        allocated: set[str] = set()
        for i in misses:
            mm_hash = features[i].identifier
            if mm_hash in allocated:  # duplicate content inside this batch of items
                cache.check_and_update_cache(request_id, mm_hash)
            else:
                cache.allocate(request_id, mm_hash, features[i].mm_position.length)
                allocated.add(mm_hash)
        return True

    def free_behind_window(self, request: Request) -> None:
        """Release the cache entries (and host PCM) of the items behind the window start.
        Items a cut skipped before they were encoded (Stream.skip_silence) are never encoded:
        they count as encoded and freed, with no cache entry to release."""
        features = request.mm_features
        lo, _ = get_mm_features_in_window(features, request.window_start, request.window_start + 1)
        for i in range(request.num_freed_items, lo):
            if i < request.num_encoded_items:
                self.encoder_cache.free_encoder_input(request.request_id, features[i].identifier)
            features[i].data = None
        request.num_freed_items = max(request.num_freed_items, lo)
        request.num_encoded_items = max(request.num_encoded_items, request.num_freed_items)

    def reset_encoder_cache(self, requests: Iterable[Request]) -> None:
        """The model runner was replaced (its worker died): it holds no encoder outputs.
        Every request's cached items (behind its window start: none) are entered anew and
        encoded again in the next step."""
        self.encoder_cache.reset()
        self.reencode.clear()
        for request in requests:
            self.free_behind_window(request)
            held = range(request.num_freed_items, request.num_encoded_items)
            if self._allocate(request, held):
                self.reencode[request.request_id] = list(held)
            else:  # (they fitted in the cache before; just in case) encode them when scheduled
                request.num_encoded_items = request.num_freed_items
