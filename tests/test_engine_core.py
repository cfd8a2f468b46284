"""Torch-free engine core: windows, encoder-cache bookkeeping, scheduler, placeholders."""

import random
from collections import deque
from functools import partial

import pytest

from engine.encoder_cache import EncoderCacheManager
from engine.load import (
    ADMIT_LAG_S,
    ADMIT_SHARE,
    HYSTERESIS,
    PARTIAL_SLOWDOWN,
    SEARCH_SHARE,
    SHED_SHARE,
    LoadMeter,
)
from engine.mm_window import get_mm_features_in_window
from engine.policy import CONTEXT_WORDS, LocalAgreement
from engine.request import (
    MMFeature,
    PlaceholderRange,
    Request,
    fill_placeholders,
    first_placeholder,
)
from engine.scheduler import Scheduler, SchedulerConfig
from engine.words import Word


class Scheduling:
    """The scheduler with the engine's side of it: the requests it reads, and the cut that
    the commit step makes (Stream._cut: the window start moves, its pauses and items behind
    it go)."""

    def __init__(self, config: SchedulerConfig | None = None):
        self.scheduler = Scheduler(config)
        self.requests: dict[str, Request] = {}
        self.config, self.encoder_cache = self.scheduler.config, self.scheduler.encoder_cache

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def finish_request(self, request_id: str) -> None:
        self.scheduler.finish_request(self.requests.pop(request_id))

    def schedule(self):
        return self.scheduler.schedule(self.requests.values())

    def note_final_due(self, request: Request) -> None:
        self.scheduler.note_final_due(request)

    def advance_window(self, request: Request, start: int) -> None:
        request.window_start = start
        while request.endpoints and request.endpoints[0] <= start:
            request.endpoints.popleft()
        self.scheduler.free_behind_window(request)


def make_request(request_id: str, num_items: int, length: int = 4, hashes=None) -> Request:
    request = Request(request_id)
    for i in range(num_items):
        mm_hash = hashes[i] if hashes else f"{request_id}-{i}"
        request.mm_features.append(MMFeature(mm_hash, PlaceholderRange(i * length, length)))
    request.last_speech_end = request.num_positions  # every item is speech (the engine measures it)
    return request


def add_items(request: Request, num_items: int, length: int = 4) -> None:
    for _ in range(num_items):
        i = request.num_items
        request.mm_features.append(
            MMFeature(f"{request.request_id}-{i}", PlaceholderRange(request.num_positions, length)))
    request.last_speech_end = request.num_positions


def schedule_in_flight(scheduler: Scheduler) -> list[tuple[str, bool]]:
    """Schedule a step and mark its requests in flight, as Engine.schedule does ->
    (request id, final) per window."""
    out = scheduler.schedule()
    for w in out.windows:
        scheduler.requests[w.request_id].output_token_ids.append(-1)
    return [(w.request_id, w.final) for w in out.windows]


def brute_window(features, start, end):
    idx = [i for i, f in enumerate(features)
           if f.mm_position.offset < end and f.mm_position.end > start]
    return (idx[0], idx[-1] + 1) if idx else None


def test_window_lookup_matches_brute_force_with_gaps():
    rng = random.Random(7)
    features, pos = [], 0
    for i in range(300):
        pos += rng.choice([0, 0, 3])  # gaps between items
        length = rng.randint(1, 6)
        features.append(MMFeature(str(i), PlaceholderRange(pos, length)))
        pos += length
    for _ in range(2000):
        start = rng.randint(0, pos + 5)
        end = start + rng.randint(1, 60)
        lo, hi = get_mm_features_in_window(features, start, end)
        expected = brute_window(features, start, end)
        if expected is None:
            assert lo == hi
        else:
            assert (lo, hi) == expected


def test_window_lookup_edges():
    assert get_mm_features_in_window([], 0, 10) == (0, 0)
    features = make_request("r", 3).mm_features  # positions [0,4) [4,8) [8,12)
    assert get_mm_features_in_window(features, 0, 4) == (0, 1)
    assert get_mm_features_in_window(features, 4, 5) == (1, 2)
    assert get_mm_features_in_window(features, 3, 9) == (0, 3)
    assert get_mm_features_in_window(features, 12, 20) == (3, 3)


def test_placeholder_range_embeds():
    plain = PlaceholderRange(10, 4)
    assert plain.get_num_embeds() == 4
    assert plain.get_embeds_indices_in_range(1, 3) == (1, 3)
    assert plain.get_embeds_indices_in_range(-5, 99) == (0, 4)
    masked = PlaceholderRange(0, 5, is_embed=[True, False, True, True, False])
    assert masked.embeds_cumsum == [1, 1, 2, 3, 3]
    assert masked.get_num_embeds() == 3
    assert masked.get_embeds_indices_in_range(0, 5) == (0, 3)
    assert masked.get_embeds_indices_in_range(1, 3) == (1, 2)
    assert masked.get_embeds_indices_in_range(2, 2) == (0, 0)
    empty = PlaceholderRange(0, 0, is_embed=[])
    assert empty.get_num_embeds() == 0
    assert empty.get_embeds_indices_in_range(0, 1) == (0, 0)


def test_placeholders_fill_oldest_first_from_the_end():
    ids = [5, 6]
    assert first_placeholder(ids) == 2
    ids += [-1, -1, -1]
    assert first_placeholder(ids) == 2
    fill_placeholders(ids, [7])
    assert ids == [5, 6, 7, -1, -1]
    fill_placeholders(ids, [8, 9])
    assert ids == [5, 6, 7, 8, 9] and first_placeholder(ids) == 5


def test_encoder_cache_duplicate_hashes_in_one_request():
    cache = EncoderCacheManager(cache_size=8)
    assert not cache.check_and_update_cache("r", "silence")
    assert cache.can_allocate(4)
    cache.allocate("r", "silence", 4)
    assert cache.check_and_update_cache("r", "silence")  # a second silent item
    assert cache.get_cached_input_ids("r") == {"silence"}
    cache.free_encoder_input("r", "silence")  # first item falls behind the window
    assert cache.get_cached_input_ids("r") == {"silence"}  # the second still uses it
    assert "silence" not in cache.freeable
    cache.free_encoder_input("r", "silence")
    assert cache.get_cached_input_ids("r") == set()
    assert "r" not in cache.request_cached_ids
    assert list(cache.freeable) == ["silence"]
    # evicting it to make room reports it to the runner
    assert cache.can_allocate(8)
    assert cache.get_freed_mm_hashes() == ["silence"]
    assert cache.num_free_slots == 8


def test_free_encoder_input_cleans_index_after_eviction():
    cache = EncoderCacheManager(cache_size=4)
    cache.allocate("r", "a", 4)
    cache.check_and_update_cache("s", "a")
    cache.free("r")
    cache.free("s")
    assert cache.can_allocate(4) and cache.get_freed_mm_hashes() == ["a"]
    cache.request_cached_ids["r"] = {"a"}  # a stale entry for an evicted hash
    cache.free_encoder_input("r", "a")
    assert cache.request_cached_ids == {}


def test_scheduler_exact_counts_and_freeing():
    config = SchedulerConfig(max_num_seqs=4, encoder_budget=1000, encoder_cache_size=1000,
                             decode_interval=50)
    scheduler = Scheduling(config)
    a = make_request("a", 20)  # 80 positions
    b = make_request("b", 5)  # 20 positions: not enough for a decode yet
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert [w.request_id for w in out.windows] == ["a"]
    w = out.windows[0]
    assert (w.window_start, w.window_end, w.item_lo, w.item_hi) == (0, 80, 0, 20)
    assert out.encoder_inputs == {"a": list(range(20))}
    assert out.num_encoder_positions == 80
    assert scheduler.encoder_cache.num_free_slots == 920
    # nothing new: no decode
    assert scheduler.schedule().windows == []
    # 13 new items (52 positions) -> decode again, only the new items are encoded
    add_items(a, 13)
    out = scheduler.schedule()
    assert out.encoder_inputs == {"a": list(range(20, 33))}
    assert out.windows[0].window_end == 132
    # commit boundary at position 40: items 0..9 are freed
    scheduler.advance_window(a, 40)
    assert a.num_freed_items == 10
    assert len(scheduler.encoder_cache.get_cached_input_ids("a")) == 23
    assert scheduler.encoder_cache.num_free_slots == 1000 - 132  # freeable until evicted
    assert len(scheduler.encoder_cache.freeable) == 10
    add_items(a, 13)
    out = scheduler.schedule()
    w = out.windows[0]
    assert (w.window_start, w.item_lo, w.item_hi) == (40, 10, 46)
    scheduler.finish_request("a")
    assert scheduler.encoder_cache.request_cached_ids.keys() == set()
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_scheduler_budget_and_cache_full_wait_instead_of_raising():
    config = SchedulerConfig(max_num_seqs=8, encoder_budget=100, encoder_cache_size=120,
                             decode_interval=50)
    scheduler = Scheduling(config)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 15))  # 60 positions each
    out = scheduler.schedule()
    assert [w.request_id for w in out.windows] == ["a"]  # budget 100 fits one
    out = scheduler.schedule()
    assert [w.request_id for w in out.windows] == ["b"]
    out = scheduler.schedule()  # cache holds 120: c must wait
    assert out.windows == []
    scheduler.finish_request("a")
    out = scheduler.schedule()
    assert [w.request_id for w in out.windows] == ["c"]
    assert sorted(out.freed_mm_hashes) == sorted(f"a-{i}" for i in range(15))


def test_random_steps_keep_cache_invariants():
    rng = random.Random(1234)
    config = SchedulerConfig(max_num_seqs=3, encoder_budget=200, encoder_cache_size=400,
                             decode_interval=8)
    scheduler = Scheduling(config)
    cache = scheduler.encoder_cache
    live: dict[str, Request] = {}
    pool = [f"h{i}" for i in range(30)]  # shared content: duplicates within and across
    runner: set[str] = set()  # the hashes the model runner holds
    num_windows = 0
    next_id = 0
    for _ in range(3000):
        action = rng.random()
        if action < 0.05 or not live:
            rid = f"r{next_id}"
            next_id += 1
            live[rid] = Request(rid)
            scheduler.add_request(live[rid])
        elif action < 0.08:
            rid = rng.choice(list(live))
            scheduler.finish_request(rid)
            del live[rid]
        elif action < 0.6:
            request = live[rng.choice(list(live))]
            for _ in range(rng.randint(1, 6)):
                request.mm_features.append(MMFeature(
                    rng.choice(pool), PlaceholderRange(request.num_positions, 4)))
            request.last_speech_end = request.num_positions  # speech (decode_only_speech)
        elif action < 0.63:  # a cut ahead of what was decoded (Stream.skip_silence: no free)
            request = live[rng.choice(list(live))]
            request.window_start = rng.randint(request.window_start, request.num_positions)
            while request.endpoints and request.endpoints[0] <= request.window_start:
                request.endpoints.popleft()
        elif action < 0.64:  # a new model worker: its cache is empty (Engine.restart_runner)
            scheduler.scheduler.reset_encoder_cache(live.values())
            runner.clear()
        else:
            out = scheduler.schedule()
            runner.difference_update(out.freed_mm_hashes)
            for rid, items in out.encoder_inputs.items():
                runner.update(live[rid].mm_features[i].identifier for i in items)
            num_windows += len(out.windows)
            for w in out.windows:
                request = live[w.request_id]
                needed = {f.identifier for f in request.mm_features[w.item_lo : w.item_hi]}
                assert needed <= runner, "a window reads items the runner does not hold"
                if rng.random() < 0.5:  # a commit somewhere in the window
                    scheduler.advance_window(request, rng.randint(w.window_start, w.window_end))
        # invariants
        refs_total = 0
        for mm_hash, refs in cache.cached.items():
            assert all(n > 0 for n in refs.values())
            assert (mm_hash in cache.freeable) == (not refs)
            for rid in refs:
                assert mm_hash in cache.request_cached_ids[rid]
            refs_total += sum(refs.values())
        for rid, ids in cache.request_cached_ids.items():
            assert rid in live and ids
            for mm_hash in ids:
                assert rid in cache.cached[mm_hash]
        for rid, request in live.items():
            held = request.num_encoded_items - request.num_freed_items
            assert sum(cache.cached[f.identifier].get(rid, 0) > 0 for f in
                       request.mm_features[request.num_freed_items:request.num_encoded_items]) == held
        expected_refs = sum(r.num_encoded_items - r.num_freed_items for r in live.values())
        assert refs_total == expected_refs
        used = sum(cache.sizes[h] for h in cache.cached)
        assert cache.num_free_slots == cache.cache_size - used >= 0
    assert num_windows > 500
    for rid in list(live):
        scheduler.finish_request(rid)
    assert cache.request_cached_ids == {}
    assert cache.num_referenced == 0
    assert len(cache.freeable) == len(cache.cached)


def test_requests_in_flight_are_not_scheduled_again_until_updated():
    scheduler = Scheduling(SchedulerConfig(decode_interval=4))
    for rid in ("a", "b"):
        scheduler.add_request(make_request(rid, 3))
    first = scheduler.schedule()
    assert [w.request_id for w in first.windows] == ["a", "b"]
    for rid in ("a", "b"):
        scheduler.requests[rid].output_token_ids.append(-1)  # what Engine.schedule does
    add_items(scheduler.requests["a"], 2)  # more audio arrives while the step runs
    assert scheduler.schedule().windows == []  # both still in flight
    fill_placeholders(scheduler.requests["a"].output_token_ids, [7])
    second = scheduler.schedule()
    assert [(w.request_id, w.window_end) for w in second.windows] == [("a", 20)]


def test_a_pause_makes_a_final_window_that_ends_there_and_goes_first():
    config = SchedulerConfig(max_num_seqs=1, encoder_budget=10_000, encoder_cache_size=10_000,
                             decode_interval=50)
    scheduler = Scheduling(config)
    a, b = make_request("a", 40), make_request("b", 40)  # 160 positions each
    b.endpoints.extend([60, 120])  # pauses after speech at positions 60 and 120
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()  # one window per step: b's final goes before a's partial
    assert [(w.request_id, w.window_start, w.window_end, w.final) for w in out.windows] == [
        ("b", 0, 60, True)]  # the window ends at the first pause, not at the audio's end
    b.output_token_ids.append(-1)  # in flight, as the engine marks it
    out = scheduler.schedule()
    assert [(w.request_id, w.window_end, w.final) for w in out.windows] == [("a", 160, False)]
    fill_placeholders(b.output_token_ids, [0])
    scheduler.advance_window(b, 60)  # the engine cuts the final window at its end
    assert list(b.endpoints) == [120]
    out = scheduler.schedule()
    assert [(w.request_id, w.window_start, w.window_end, w.final) for w in out.windows] == [
        ("b", 60, 120, True)]


def test_finals_per_step_are_limited_when_asked_and_wait_first_in_line():
    scheduler = Scheduling(SchedulerConfig(max_finals=2, decode_interval=4))
    requests = [make_request(rid, 10) for rid in ("a", "b", "c", "d")]
    for request in requests[1:]:
        request.endpoints.append(20)
    for request in requests:
        scheduler.add_request(request)

    step = partial(schedule_in_flight, scheduler)

    assert step() == [("b", True), ("c", True)]  # two finals, no partial
    assert step() == [("d", True)]  # the third final before a's partial
    assert step() == [("a", False)]


def test_finals_go_in_the_order_they_fell_due_not_in_queue_order():
    scheduler = Scheduling(SchedulerConfig(max_finals=1, decode_interval=4))
    requests = {rid: make_request(rid, 10) for rid in ("a", "b", "c")}
    for request in requests.values():
        scheduler.add_request(request)

    step = partial(schedule_in_flight, scheduler)

    assert step() == [("a", False), ("b", False), ("c", False)]  # c is now last in the queue
    requests["c"].endpoints.append(20)  # c's pause comes while its partial runs
    for rid in ("a", "b"):
        fill_placeholders(requests[rid].output_token_ids, [0])
    assert step() == []  # c is in flight; a and b have nothing new
    fill_placeholders(requests["c"].output_token_ids, [0])
    for rid in ("a", "b"):
        requests[rid].endpoints.append(20)  # their pauses come after c's
    assert step() == [("c", True)]  # first in line, though last in the queue
    assert step() == [("a", True)]
    assert step() == [("b", True)]


def test_a_final_no_longer_due_loses_its_place_in_line():
    scheduler = Scheduling(SchedulerConfig(decode_interval=4))
    a, b = make_request("a", 10), make_request("b", 10)
    for request in (a, b):
        scheduler.add_request(request)
    a.endpoints.append(20)
    scheduler.note_final_due(a)  # as the engine does when the pause comes in
    b.endpoints.append(20)
    scheduler.note_final_due(b)
    assert (a.due_number, b.due_number) == (1, 2)
    scheduler.advance_window(a, 24)  # a cut past a's pause: no final due for a
    assert schedule_in_flight(scheduler) == [("b", True)]  # a does not go first as a partial
    assert a.due_number is None and b.due_number is None


def test_partials_per_step_are_limited_but_finals_are_not():
    scheduler = Scheduling(SchedulerConfig(max_partials=1, decode_interval=4))
    requests = [make_request(rid, 10) for rid in ("a", "b", "c", "d")]
    requests[2].endpoints.append(20)
    requests[3].input_finished = True
    for request in requests:
        scheduler.add_request(request)

    step = partial(schedule_in_flight, scheduler)

    assert step() == [("c", True), ("d", True)]  # both finals; a step with finals has no partials
    assert step() == [("a", False)]  # one partial a step
    assert step() == [("b", False)]  # b's turn; the others are in flight
    for request in requests[:2]:
        fill_placeholders(request.output_token_ids, [0])
        add_items(request, 2)
    assert step() == [("a", False)]  # one partial a step, round-robin: b waits though ready
    assert step() == [("b", False)]
    scheduler.config.finals_alone = False
    for request in requests:
        fill_placeholders(request.output_token_ids, [0])
    add_items(requests[0], 2)
    requests[2].endpoints.append(40)
    assert step() == [("c", True), ("d", True), ("a", False)]  # finals and one partial


def test_a_background_file_waits_for_live_work_and_steps_alone():
    scheduler = Scheduling(SchedulerConfig(max_partials=2, decode_interval=4))
    file, live, other = make_request("file", 30), make_request("live", 10), make_request("other", 10)
    file.background, file.endpoints = True, deque([40, 80])  # a backlog of finals, due first
    for request in (file, live, other):
        scheduler.add_request(request)
    live.endpoints.append(20)

    step = partial(schedule_in_flight, scheduler)

    assert step() == [("live", True)]  # the file's finals fell due first, yet wait
    assert step() == [("other", False)]  # a live partial: the file does not join it
    assert step() == [("file", True)]  # nothing live is ready: the file's step
    for request in (file, other):
        fill_placeholders(request.output_token_ids, [0])
    scheduler.advance_window(file, 40)
    other.endpoints.append(40)
    assert step() == [("other", True)]  # the file's next final waits again
    scheduler.config.finals_alone = False  # (a GPU) a file's window joins live ones
    for request in (live, other):
        fill_placeholders(request.output_token_ids, [0])
    scheduler.advance_window(live, 20)
    scheduler.advance_window(other, 40)
    add_items(live, 2)
    assert step() == [("live", False), ("file", True)]
    scheduler.config.max_partials = 1
    fill_placeholders(live.output_token_ids, [0])
    fill_placeholders(file.output_token_ids, [0])
    add_items(live, 2)
    assert step() == [("live", False)]  # the file counts against max_partials, last


def words(text: str, start_ms: int = 0, step_ms: int = 300) -> list[Word]:
    return [Word(f" {w}", start_ms + i * step_ms, start_ms + (i + 1) * step_ms)
            for i, w in enumerate(text.split())]


def test_local_agreement_commits_agreed_words_and_a_final_never_drops_the_tentative_tail():
    policy = LocalAgreement()
    assert policy.update(words("he might even")).committed == []
    update = policy.update(words("he might even have been"))
    assert [w.key for w in update.committed] == ["he", "might", "even"]
    assert [w.key for w in update.tentative] == ["have", "been"]
    # the final decode of a window cut short hears nothing: the tentative words are kept
    assert [w.key for w in policy.flush([]).committed] == ["have", "been"]
    assert [w.key for w in policy.committed] == ["he", "might", "even", "have", "been"]
    # a final decode that repeats only committed words commits the tentative tail too
    policy.update(words("he might even have been made amiable"))
    assert [w.key for w in policy.flush(words("he might even have been")).committed] == ["made", "amiable"]
    assert policy.flush([]).committed == []  # nothing tentative left: nothing to commit


def test_one_word_read_at_two_places_seconds_apart_is_not_agreement():
    """Run-on speech: one partial read its window from the start ("the storm arrived"), the
    next passed over 15 s of it and read the sentence at the window's end ("the planet
    higher"). Their first words agree in text alone; committed, "the" at 16 s would hold every
    word the speech before it is read as later (committed times only go forward)."""
    policy = LocalAgreement()
    policy.update(words("the storm arrived", 1_000))
    assert policy.update(words("the planet higher", 16_000)).committed == []
    assert policy.update(words("the storm arrived in", 1_100)).committed == []
    update = policy.update(words("the storm arrived in the", 1_000))
    assert [w.key for w in update.committed] == ["the", "storm", "arrived", "in"]
    assert update.committed[0].start_ms == 1_000
    # the alignment's usual spread from one reading to the next is agreement
    policy = LocalAgreement()
    policy.update(words("he might even", 0, 300))
    update = policy.update(words("he might even have", 500, 250))  # placed 0.4-0.5 s later
    assert [w.key for w in update.committed] == ["he", "might", "even"]
    # a reading that could not commit spread its segment's time by characters: not compared
    policy = LocalAgreement()
    policy.update(words("the storm arrived", 1_000, 1_200), commit=False, timed=False)  # " arrived" 3.4 s
    update = policy.update(words("the storm arrived in", 1_000, 300))
    assert [w.key for w in update.committed] == ["the", "storm", "arrived"]


def test_only_silence_since_the_last_decode_is_not_decoded_again():
    scheduler = Scheduling(SchedulerConfig(decode_interval=50))
    request = make_request("a", 20)  # 80 positions of speech
    scheduler.add_request(request)
    assert [w.window_end for w in scheduler.schedule().windows] == [80]
    add_items(request, 20)
    request.last_speech_end = 80  # the new second is silence
    assert scheduler.schedule().windows == []
    request.last_speech_end = 120  # speech again
    assert [w.window_end for w in scheduler.schedule().windows] == [160]
    config = SchedulerConfig(decode_interval=50, decode_only_speech=False)
    scheduler, request = Scheduling(config), make_request("b", 20)
    request.last_speech_end = 0
    scheduler.add_request(request)
    assert [w.window_end for w in scheduler.schedule().windows] == [80]


def test_partials_after_a_final_are_previews_until_they_could_commit():
    scheduler = Scheduling(SchedulerConfig(decode_interval=4, preview_positions=40))
    request = make_request("a", 9)  # 36 positions
    scheduler.add_request(request)

    def step() -> tuple[int, int, bool, bool]:
        (w,) = scheduler.schedule().windows
        return w.window_start, w.window_end, w.final, w.preview

    assert step() == (0, 36, False, True)  # nothing committed yet: a preview from 0
    request.endpoints.append(36)
    assert step() == (0, 36, True, False)  # finals decode the whole window
    request.endpoints.clear()
    request.preview_start = 36  # what the engine sets after that final
    add_items(request, 5)
    assert step() == (36, 56, False, True)  # only the audio since the final
    add_items(request, 5)
    assert step() == (0, 76, False, False)  # 40 positions since the final: could commit
    request.window_start = 60  # a cut past the preview start
    add_items(request, 2)
    assert step() == (60, 84, False, False)


def test_the_load_is_the_share_of_recent_time_on_live_finals_and_sets_the_shedding():
    meter = LoadMeter(window_s=10.0)
    meter.record(0.0, 4.0, ())  # partials: optional work is no load
    assert meter.share(10.0) == 0.0 and not meter.update(10.0)
    meter.record(10.0, 10.0 + 10 * SHED_SHARE, {"a"})
    assert meter.share(20.0) == SHED_SHARE and meter.update(20.0)
    # held until the share is HYSTERESIS under its threshold
    meter.record(20.0, 20.0 + 10 * (SHED_SHARE - HYSTERESIS / 2), {"a"})
    assert meter.update(30.0)
    meter.record(30.0, 30.0 + 10 * (SHED_SHARE - HYSTERESIS * 1.5), {"a"})
    assert not meter.update(40.0)
    assert meter.share(60.0) == 0.0 and meter.admits(60.0, {})  # steps age out


def test_finals_are_searched_while_the_load_is_under_search_share():
    meter = LoadMeter(window_s=10.0)
    meter.update(0.0)
    assert meter.searching  # idle
    meter.record(0.0, 10 * SEARCH_SHARE * 0.9, {"a"})
    meter.update(10.0)
    assert meter.searching and not meter.shedding
    meter.record(10.0, 10.0 + 10 * SEARCH_SHARE, {"a", "b"})
    meter.update(20.0)
    assert not meter.searching and not meter.shedding  # searches go before partials
    meter.update(40.0)
    assert meter.searching  # aged out


def test_a_session_is_admitted_while_the_load_with_it_and_those_to_come_fits():
    meter = LoadMeter(window_s=10.0)
    part = ADMIT_SHARE / 5.5  # four sessions' finals took 4 parts of the last 10 s
    meter.record(60.0, 60.0 + 10 * 2 * part, {"a", "b"})
    meter.record(65.0, 65.0 + 10 * 2 * part, {"c", "d"})
    assert meter.share(70.0) == pytest.approx(4 * part)
    speaking = {rid: 0.0 for rid in "abcd"}
    assert meter.admits(70.0, speaking)  # 4 + 1 parts
    idle = {"idle": 50.0}  # open the whole window without a final: an idle microphone
    assert meter.admits(70.0, speaking | idle)
    new = {"new": 62.0}  # opened in the window, its first final still to come: one part
    assert not meter.admits(70.0, speaking | new)  # 4 + 1 + 1 parts are over ADMIT_SHARE
    assert meter.admits(75.0, speaking | new)  # a's and b's finals aged out: 2 + 1 parts


def test_no_session_is_admitted_while_the_sessions_lag_at_their_commits():
    meter = LoadMeter(window_s=10.0)
    for _ in range(18):
        meter.note_lag(5.0, 0.8)  # at ease: a pause and a step behind
    assert meter.lag(5.0) == 0.8 and meter.admits(5.0, {})
    meter.note_lag(5.0, ADMIT_LAG_S + 1.0)
    meter.note_lag(5.0, ADMIT_LAG_S + 1.0)
    assert meter.admits(5.0, {})  # two in twenty: the p90 is still at ease
    meter.note_lag(6.0, ADMIT_LAG_S + 1.0)
    assert meter.lag(6.0) > ADMIT_LAG_S and not meter.admits(6.0, {})
    assert meter.lag(16.0) == 0.0 and meter.admits(16.0, {})  # aged out


def test_under_load_partials_come_less_often_but_finals_do_not():
    config = SchedulerConfig(decode_interval=4)
    scheduler = Scheduling(config)
    short, long, pausing = make_request("a", 2), make_request("b", 12), make_request("c", 1)
    for request in (short, long, pausing):
        scheduler.add_request(request)
    pausing.endpoints.append(4)

    def ready() -> set[str]:
        return {rid for rid, r in scheduler.requests.items() if scheduler.scheduler.is_ready(r)}

    assert ready() == {"a", "b", "c"}
    scheduler.scheduler.shedding = True
    assert ready() == {"b", "c"}  # a partial waits 3 intervals now: a has 8 positions, b 48
    add_items(short, 1)  # 12 positions: 3 intervals
    assert ready() == {"a", "b", "c"} and config.decode_interval * PARTIAL_SLOWDOWN == 12


def test_a_final_window_without_speech_is_not_marked_for_decoding():
    scheduler = Scheduling(SchedulerConfig(decode_interval=4))
    request = make_request("a", 10)
    scheduler.add_request(request)
    request.window_start = request.num_decoded_positions = 40  # committed and cut at 40
    add_items(request, 5)
    request.last_speech_end = 40  # the new items are silence
    request.input_finished = True
    (window,) = scheduler.schedule().windows
    assert (window.window_start, window.window_end, window.final, window.speech) == (40, 60, True, False)
    # a pause's final committed [0, 40) and the window was not cut: the finish has nothing new
    request.window_start, request.preview_start = 0, 40
    request.num_decoded_positions = 40
    (window,) = scheduler.schedule().windows
    assert (window.window_start, window.window_end, window.final, window.speech) == (0, 60, True, False)
    request.last_speech_end = 44  # speech after the last final: decode the whole window
    (window,) = scheduler.schedule().windows
    assert (window.window_start, window.window_end, window.speech) == (0, 60, True)


def test_a_committed_tail_is_found_when_a_re_decode_spells_earlier_words_differently():
    policy = LocalAgreement()
    policy.flush(words("probably means to leave john a well defined food"))
    policy.flush(words("the yang golavadem shows the flowers compared with the sun", 3000))
    # unclear speech re-decoded in more words: the tail sits 4 words later than counted, and
    # its mid-times lie past the committed end
    hypothesis = words("poni means daily children and we have the fine food by mans inn the young "
                       "guadalajas inn shows the flowers compared with the sun had he married", 0, 300)
    committed = policy.flush(hypothesis).committed
    assert [w.key for w in committed] == ["had", "he", "married"]


@pytest.mark.parametrize("before, hypothesis, shift_ms, new", [
    # the re-decode put a word before the last one, inside the committed words' audio: "most
    # of" is found, and "afternoon" past it
    ("the match was tied for most of afternoon",
     "the match was tied for most of the afternoon most teams played", 0, "most teams played"),
    # the re-decode spelled the last word nearly the same, its middle past the committed end
    ("in the middle of the fridge", "in the middle of ridge eight of spades", 400,
     "eight of spades"),
])
def test_a_re_decoded_last_word_is_not_committed_again(before, hypothesis, shift_ms, new):
    policy = LocalAgreement()
    policy.flush(words(before))
    committed = policy.flush(words(hypothesis, shift_ms)).committed
    assert " ".join(w.key for w in committed) == new


def test_a_last_word_the_re_decode_left_out_does_not_take_the_next_sentences_first():
    """A re-decode that changed a word and left out the committed last word ("anyone had
    expected it." read "anyone said expected.") has the tail before the last word, and the
    word after that is the next sentence's, after the pause: it is new, not the last word
    read again."""
    before = "the first snow fell on the fields before anyone had expected it"
    policy = LocalAgreement()
    policy.flush(words(before))
    end_ms = 300 * len(before.split())
    hypothesis = (words("the first snow fell on the fields before anyone said", 0)
                  + [Word(" expected.", 3000, end_ms)]
                  + words("when i was a child", end_ms + 1_200))
    committed = policy.flush(hypothesis).committed
    assert " ".join(w.key for w in committed) == "when i was a child"


def spread(text: str, start_ms: int, end_ms: int) -> list[Word]:
    """Words read evenly over [start_ms, end_ms)."""
    keys = text.split()
    step = (end_ms - start_ms) // len(keys)
    return [Word(f" {w}", start_ms + i * step, start_ms + (i + 1) * step) for i, w in enumerate(keys)]


@pytest.mark.parametrize("before, reread", [
    # the tail ("after sunlight") lies three words later than counting puts it
    ("a modern train left the station just after sunlight",
     "but it's the more in turn left the station does after sunlight"),
    # the last word spelled nearly the same, four words later than counted
    ("my grandmom has hinted we have to known pulling weeds and talking quietly to our plans",
     "my grandmom has been dead we have to move all in weeds and talk in quietly to hot lands"),
])
def test_a_last_word_re_decoded_where_it_was_is_not_committed_again(before, reread):
    """A final re-decoding unclear speech in more words than the committed reading puts the
    committed tail further off than counting allows; it is still the same word where the
    committed one lies in time, and not new speech."""
    policy = LocalAgreement()
    said = words(before)
    policy.flush(said)
    last = said[-1]
    # the re-decode's last word starts inside the committed last word, its middle past its end
    hypothesis = spread(reread, 0, last.end_ms + 200) + words("mr john dashwood", last.end_ms + 1_500)
    assert hypothesis[-4].start_ms < last.end_ms <= hypothesis[-4].mid_ms + 100
    committed = policy.flush(hypothesis).committed
    assert " ".join(w.key for w in committed) == "mr john dashwood"
    # a new word spelled the same after the committed one is new speech
    policy = LocalAgreement()
    policy.flush(words(before))
    again = spread(reread, 0, last.end_ms) + words(f"{reread.split()[-1]} mr john", last.end_ms + 1_500)
    assert " ".join(w.key for w in policy.flush(again).committed) == f"{reread.split()[-1]} mr john"


def tokens_of(said: list[Word], vocabulary: dict[str, int]) -> list[Word]:
    for w in said:
        w.tokens = [vocabulary.setdefault(w.key, len(vocabulary))]
    return said


def prompt_keys(policy: LocalAgreement, vocabulary: dict[str, int], max_tokens: int) -> list[str]:
    """The words of a policy's prompt, their tokens given by `tokens_of`."""
    key = {i: k for k, i in vocabulary.items()}
    return [key[t] for t in policy.prompt_tokens(max_tokens)]


def test_a_prompt_reads_committed_words_as_the_latest_decode_of_their_window_read_them():
    """The committed text stays as committed; later windows' prompts read it as the last
    decode of its window did, with more of the speech after it."""
    vocabulary: dict[str, int] = {}
    said = lambda text, start_ms=0: tokens_of(words(text, start_ms), vocabulary)  # noqa: E731
    prompt = lambda policy: " ".join(prompt_keys(policy, vocabulary, 100))  # noqa: E731

    policy = LocalAgreement()
    policy.flush(said("he was not an old-sposed young man"))
    # the next final reads the window again with the next sentence: "ill-disposed"
    hypothesis = said("he was not an ill-disposed young man he might even")
    policy.read_window(hypothesis)
    assert [w.key for w in policy.flush(hypothesis).committed] == ["he", "might", "even"]
    assert prompt(policy) == ""  # all of it is in the window
    policy.cut_window(3_000)
    assert prompt(policy) == "he was not an illdisposed young man he might even"
    assert " ".join(w.key for w in policy.committed[:7]) == "he was not an oldsposed young man"

    # a decode that did not read the committed words again (no tail found) changes nothing
    policy.flush(said("have been made amiable himself", 3_000))
    policy.read_window(said("have beaten many others", 3_000))
    # nor does one of a window that holds text from before a hot decode (`reset_prompt`)
    policy.reset_prompt()
    policy.flush(said("and mister john", 4_500))
    policy.read_window(said("has been made amiable himself and mr john", 3_000))
    policy.cut_window(6_000)
    assert prompt(policy) == "and mister john"


def test_a_window_kept_from_a_sentences_start_leaves_the_word_it_cuts_into_in_the_prompt():
    """A final's cut keeps its last sentence as the next windows' context: it starts 200 ms
    before the word before's end (`sentence_start_ms`), on an item (up to 80 ms earlier).
    Whisper rarely reads that word's last 0.3 s again: it is the prompt's last word, full
    stop and all, and stays in the prompts after the window's next decode (lost, the prompts
    read "soft and slightly Leave it covered")."""
    vocabulary: dict[str, int] = {}
    said = lambda text, start_ms, step_ms=400: tokens_of(words(text, start_ms, step_ms), vocabulary)  # noqa: E731
    for rounding in (0, 79):  # the cut on an item, or up to 80 ms before
        policy = LocalAgreement()
        first = said("feels soft and slightly sticky.", 6_440, 400)  # "sticky." 8.04-8.44 s
        policy.flush(first + said("leave it covered in time.", 9_250))
        assert policy.sentence_start_ms(10_000, finished=True) == 8_240
        policy.cut_window(8_240 - rounding)
        assert policy.num_window_committed == policy.num_window_context == 5
        assert prompt_keys(policy, vocabulary, 100)[-2:] == ["slightly", "sticky"]
    # the next decode of the window; where it reads the word's tail again, that is not its text
    for tail in ("", "see"):
        reading = said(tail, 8_160, 200) + said("leave it covered in time. now rest", 9_250)
        policy.read_window(reading)
        window = policy.context[len(policy.context) - policy.num_window_context :]
        assert " ".join(w.key for w in window) == "leave it covered in time"
    policy.flush(reading)
    policy.cut_window(12_000)
    assert prompt_keys(policy, vocabulary, 100) == [w.key for w in policy.committed]


def test_the_prompts_context_stays_bounded_and_its_floor_with_it_over_a_long_session():
    vocabulary: dict[str, int] = {}
    policy = LocalAgreement()
    for k in range(400):  # 1,600 words, each window cut past them
        if k == 300:
            policy.reset_prompt()  # a hot decode: nothing before it is a prompt again
        policy.flush(tokens_of(words(f"w{k} x{k} y{k} z{k}", k * 2_000), vocabulary))
        policy.cut_window(k * 2_000 + 1_300)
        assert len(policy.context) <= CONTEXT_WORDS
    prompt = prompt_keys(policy, vocabulary, 200)
    assert len(policy.committed) == 1_600 and prompt[-1] == "z399"
    assert prompt == [w.key for w in policy.committed[-len(prompt):]]
    assert len(prompt) == 200 and policy.prompt_floor == len(policy.context) - 400


def test_a_re_decoded_last_word_does_not_match_its_later_repeat():
    policy = LocalAgreement()
    policy.flush(words("to be rather selfish is to be old-sposed"))
    # the window still holds those 8 words; the re-decode heard the last one differently
    hypothesis = words("to be rather selfish is to be ill-disposed he was not an old-sposed young man")
    committed = policy.flush(hypothesis).committed
    assert [w.key for w in committed] == ["he", "was", "not", "an", "oldsposed", "young", "man"]
