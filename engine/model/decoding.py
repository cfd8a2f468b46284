"""Greedy decoding with Whisper's timestamp rules and guards against repetition loops.

`decode_batch` decodes the windows of a step together, each row as it would decode alone,
and verifies each row's draft instead of generating it token by token. The logit rules
follow openai/whisper's decoding.py: suppress blank at the start, suppress non-speech
tokens, timestamp pairing and monotonicity, a cap on the first and on the last timestamp.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.model.tokenizer import Tokenizer
from engine.model.whisper import Whisper
from engine.timeline import TIME_PRECISION
from engine.words import SENTENCE_ENDS, shift_timestamps

TOKENS_PER_SECOND = 8  # decoding budget per second of audio (speech is ~3-5 text tokens/s)
MIN_TOKEN_BUDGET = 12
MAX_REPEAT_BLOCK = 24  # longest token block checked for back-to-back repetition
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
MAX_PROMPT_TOKENS = 223  # n_text_ctx // 2 - 1
MIN_COPIED_WORDS = 3  # a shorter segment said again is no sign of copying ("Yes. Yes.")
COPIED_OPENING_WORDS = 5  # a decode opening with a prompt sentence's first words this many copies it
# a sentence's end inside a segment's text, where another sentence follows it
SENTENCE_END = re.compile(f"[{re.escape(''.join(SENTENCE_ENDS))}]+\\s+(?=\\S)")
TITLES = frozenset({"mr", "mrs", "ms", "dr", "st", "mt", "jr", "sr", "prof", "vs"})  # "Mr." ends no sentence


@dataclass
class DecodingOptions:
    timestamps: bool = True
    temperature: float = 0.0
    prompt: list[int] = field(default_factory=list)  # previous text tokens (no specials)
    audio_seconds: float = 30.0  # real audio in the window; sets the budget and timestamp cap
    max_initial_timestamp: float = 1.0
    seed: int = 0  # for temperature > 0
    # tokens greedy decoding is likely to produce (the last decode of the window, a final's
    # with its preview after it): verified, not generated (temperature 0 only; decode_batch)
    draft: list[int] = field(default_factory=list)
    # the draft's first `forced` tokens are taken as given, not verified (Whisper's prefix: the
    # text of audio the window keeps as context, committed before; at every temperature this
    # decode is given: the runner's fallback, `decode_with_fallback`, decodes without it)
    forced: int = 0
    # the VAD heard speech in the window: Whisper's no-speech probability does not make the
    # decode silence (it is high under quiet or unclear speech the VAD hears for seconds)
    speech_heard: bool = False


class DecodingCancelled(Exception):
    """The caller's `stop` asked to give up a decode (its result is no longer wanted).

    Per row of the batch: `results`, its result if it had finished, else None; `prefixes`,
    the tokens decoded so far (a greedy prefix, so a draft for the next decode of that audio).
    """

    def __init__(self, results: list[DecodingResult | None] | None = None,
                 prefixes: list[list[int]] | None = None):
        super().__init__("decoding cancelled")
        self.results = results or []
        self.prefixes = prefixes or []


@dataclass
class DecodingResult:
    tokens: list[int]  # text and timestamp tokens, without sot/eot
    text: str
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float
    stop: str  # "eot", "budget" or "repetition"
    temperature: float = 0.0
    token_logprobs: list[float] = field(default_factory=list)  # per token of `tokens`
    speech_heard: bool = False  # (DecodingOptions.speech_heard)
    # the decoder's log-probability of the given text's last token (`_given_end`: the kept
    # sentence's closing mark), hearing the whole window, the speech after it too
    given_logprob: float | None = None

    @property
    def letters(self) -> int:
        """The letters and digits its text spells: how much of the speech it read."""
        return sum(c.isalnum() for c in self.text)

    @property
    def ran_away(self) -> bool:
        """It ran past its budget, or its text compresses too well (a sentence said over and
        over): the signs of a loop that remain once a repeat's copies are dropped."""
        return self.stop == "budget" or self.compression_ratio > COMPRESSION_RATIO_THRESHOLD

    @property
    def looped(self) -> bool:
        """Whisper's signs of a decode caught in a loop: it ran away, or it repeated itself."""
        return self.ran_away or self.stop == "repetition"

    @property
    def needs_fallback(self) -> bool:
        return self.looped or self.avg_logprob < LOGPROB_THRESHOLD

    @property
    def is_silence(self) -> bool:
        """Whisper's no-speech rule, for windows the VAD heard no speech in."""
        if self.speech_heard:
            return False
        return self.no_speech_prob > NO_SPEECH_THRESHOLD and self.avg_logprob < LOGPROB_THRESHOLD


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _segments(tokenizer: Tokenizer, tokens: list[int]) -> Iterator[str]:
    """The text of each segment of a decode or prompt (between timestamps), one at a time:
    a caller that wants the first decodes no more."""
    text: list[int] = []
    for t in tokens:
        if t < tokenizer.timestamp_begin:
            text.append(t)
        elif text:
            yield tokenizer.decode(text)
            text = []
    if text:
        yield tokenizer.decode(text)


def _first_sentence(text: str, followed: bool = False) -> list[str]:
    """The words of a segment's first sentence (to its first end mark not after a title);
    with `followed`, [] unless another sentence follows it in the segment."""
    for end in SENTENCE_END.finditer(text):
        words = _words(text[: end.start()])
        if words and words[-1] not in TITLES:
            return words
    return [] if followed else _words(text)


def copies_prompt(tokenizer: Tokenizer, tokens: list[int], prompt: list[int]) -> bool:
    """Whether a decode opens with one of the prompt's segments (its sentences), word for
    word, or with the first COPIED_OPENING_WORDS words of one, or opens any of its segments
    with a short sentence that opens one of the prompt's: the decoder copying the text before
    the window instead of hearing the window. Long-form prompts invite it, the last sentence
    most, but not only (under white noise a decode read a session's first sentence again over
    its fourth, and the next its opening and made-up words after it); a sentence said again
    within a prompt's reach is rare, and decoding again without the prompt gives it back if it
    was said. A short sentence is a copy only where the segment goes on after it: in a
    reverberant room a sentence's onset was read "M." once, and every segment after it opened
    "M. ..." ("M. I'm a middle of spring" for "In the middle of spring"), the prompt's habit,
    not the audio's; a short sentence read alone ("Yes. Yes.") is no sign."""
    segments = list(_segments(tokenizer, tokens))
    said = [(_words(text), _first_sentence(text)) for text in _segments(tokenizer, prompt)]
    first = _words(segments[0]) if segments else []
    if len(first) >= MIN_COPIED_WORDS and any(
            first == words or (len(words) >= COPIED_OPENING_WORDS
                               and first[:COPIED_OPENING_WORDS] == words[:COPIED_OPENING_WORDS])
            for words, _ in said):
        return True
    openings = [_first_sentence(text, followed=True) for text in segments]
    return any(0 < len(opening) < MIN_COPIED_WORDS and opening == sentence
               for opening in openings for _, sentence in said)


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def token_budget(audio_seconds: float, n_text_ctx: int, prompt_length: int) -> int:
    budget = MIN_TOKEN_BUDGET + math.ceil(audio_seconds * TOKENS_PER_SECOND)
    return max(1, min(budget, n_text_ctx // 2, n_text_ctx - prompt_length - 1))


def repeated_tail(tokens: list[int], min_block: int = 1) -> int:
    """Length of the trailing back-to-back repetition to drop, or 0.

    A block of k tokens that occurs three times in a row at the end (k=1: five times) is a
    loop; legitimate repeats ("bye bye") are shorter. Returns the length of the copies past
    the first occurrence.
    """
    n = len(tokens)
    for k in range(min_block, min(MAX_REPEAT_BLOCK, n // 3) + 1):
        times = 5 if k == 1 else 3
        if n < k * times:
            continue
        block = tokens[n - k :]
        if all(tokens[n - k * (i + 1) : n - k * i] == block for i in range(1, times)):
            return k * (times - 1)
    return 0


class LogitRules:
    """Suppression and timestamp rules, applied to many rows of next-token logits at once.

    What a row may say next depends on its tokens so far only through four bounds
    (`bounds`): text below `text_end` is masked, timestamps below `ts_lo` and every token
    from `ts_hi` on, and at the start blank and end-of-text. So the rules of every row and
    draft position of a decoder call are applied together, in a few passes over a (rows,
    vocab) block, and only the chosen tokens leave the device (one wait per call on a GPU,
    not a few per token and row)."""

    def __init__(self, tokenizer: Tokenizer, suppress: list[int], n_vocab: int, device: torch.device):
        self.tok = tokenizer
        self.ts_begin = tokenizer.timestamp_begin
        mask = torch.zeros(n_vocab, dtype=torch.bool)
        mask[[t for t in suppress if t < n_vocab]] = True
        mask[tokenizer.eot + 1 : self.ts_begin] = True  # specials (sot, sot_prev, ...)
        self.suppress = mask.to(device)  # (vocab,)
        self.blank_ids = torch.tensor([220, tokenizer.eot], device=device)  # suppressed at the start
        self.index = torch.arange(n_vocab, device=device)  # (vocab,)
        self.device = device

    def bounds(self, options: DecodingOptions, seq: list[int],
               draft: list[int]) -> list[tuple[int, int, int, int]]:
        """The rules for the token after `seq`, then after each token of `draft` appended to
        it -> per position (text_end, ts_lo, ts_hi, blank). A sequence counts through its
        length, its last two tokens and its last timestamp, carried along the draft."""
        ts = self.ts_begin
        last_stamp = next((t for t in reversed(seq) if t >= ts), None)
        tail = seq[-2:]
        out = [self._bounds(options, len(seq), tail, last_stamp)]
        for n, token in enumerate(draft, start=len(seq) + 1):
            tail = [*tail[-1:], token]
            last_stamp = token if token >= ts else last_stamp
            out.append(self._bounds(options, n, tail, last_stamp))
        return out

    def _bounds(self, options: DecodingOptions, length: int, tail: list[int],
                last_stamp: int | None) -> tuple[int, int, int, int]:
        """The rules after a sequence of `length` tokens ending with `tail` (its last two, or
        fewer), whose last timestamp is `last_stamp`."""
        ts = self.ts_begin
        if not options.timestamps:
            return 0, ts, ts, int(not length)
        text_end, ts_lo = 0, ts
        ts_hi = ts + round(options.audio_seconds / TIME_PRECISION) + 1  # no timestamp past audio
        last_ts = length >= 1 and tail[-1] >= ts
        penultimate_ts = length < 2 or tail[-2] >= ts
        if last_ts:
            if penultimate_ts:  # a segment just ended: text or end-of-text next
                ts_hi = ts
            else:  # a segment's end timestamp next (or end-of-text)
                text_end = self.tok.eot
        if last_stamp is not None:  # timestamps never go back
            ts_lo = last_stamp if last_ts and not penultimate_ts else last_stamp + 1
        if not length:
            text_end = ts
            ts_hi = min(ts_hi, ts + round(options.max_initial_timestamp / TIME_PRECISION) + 1)
        return text_end, ts_lo, ts_hi, int(not length)

    def apply(self, logits: Tensor, bounds: list[tuple[int, int, int, int]]) -> tuple[Tensor, Tensor]:
        """logits: (R, vocab) float32, row r for the token after a sequence with `bounds[r]`,
        masked in place -> (their log-probabilities (R, vocab) before the last rule,
        timestamp_first (R,)). The last rule: where the timestamps together are likelier
        than any text token, a timestamp comes next (the row's text is masked too). Whole-row
        passes are few (a batch of long drafts is thousands of rows of 51,864 logits); the
        rows whose text the bounds mask are known on the host, so nothing waits for the
        device."""
        ts, eot = self.ts_begin, self.tok.eot
        logits.masked_fill_(self.suppress, -math.inf)
        for end in (ts, eot):  # no text at the start; after a segment's first timestamp
            rows = [r for r, b in enumerate(bounds) if b[0] == end]
            if rows:
                logits[torch.tensor(rows, device=self.device), :end] = -math.inf
        blank = [r for r, b in enumerate(bounds) if b[3]]
        if blank:
            logits[torch.tensor(blank, device=self.device)[:, None], self.blank_ids] = -math.inf
        limits = torch.tensor([b[1:3] for b in bounds], device=self.device)  # (R, 2): ts_lo, ts_hi
        stamps = self.index[: logits.shape[1] - ts] + ts  # (timestamps,)
        logits[:, ts:].masked_fill_((stamps < limits[:, :1]) | (stamps >= limits[:, 1:]), -math.inf)
        logprobs = torch.log_softmax(logits, dim=-1)
        timestamp_first = logprobs[:, ts:].logsumexp(dim=-1) > logprobs[:, :ts].max(dim=-1).values  # (R,)
        logits[:, :ts].masked_fill_(timestamp_first[:, None], -math.inf)
        return logprobs, timestamp_first


def initial_tokens(tokenizer: Tokenizer, options: DecodingOptions) -> list[int]:
    prompt = options.prompt[-MAX_PROMPT_TOKENS:]
    initial = ([tokenizer.sot_prev, *prompt] if prompt else []) + tokenizer.sot_sequence()
    if not options.timestamps:
        initial.append(tokenizer.no_timestamps)
    return initial


@torch.inference_mode()
def decode(model: Whisper, tokenizer: Tokenizer, audio_features: Tensor,
           options: DecodingOptions, suppress: list[int],
           cross: list[tuple[Tensor, Tensor]] | None = None) -> DecodingResult:
    """audio_features: (1, n_audio_ctx, n_state) encoder output -> one decoded sequence.
    `cross`: `cross_kv` of the audio if already computed."""
    return decode_batch(model, tokenizer, audio_features, [options], suppress, cross=cross)[0]


class _Row:
    """One sequence of a decoding batch: its options, budget, tokens and score so far."""

    def __init__(self, model: Whisper, options: DecodingOptions, num_initial: int, device: torch.device):
        self.options = options
        self.budget = token_budget(options.audio_seconds, model.dims.n_text_ctx, num_initial)
        self.generator = (torch.Generator(device=device).manual_seed(options.seed)
                          if options.temperature > 0 else None)
        self.seq: list[int] = []
        self.logprobs: list[float] = []  # of each token in `seq`
        self.sum_logprob = 0.0  # of every token chosen, also those a repetition drop removed
        self.num_forced = 0  # tokens of `seq` given (`DecodingOptions.forced`), not chosen
        self.stop = ""  # set when the row is done
        self.no_speech_prob = 0.0
        self.given_logprob: float | None = None
        self.pending: list[int] = []  # draft tokens greedy decoding left, waiting to resync
        self.misses = 0  # decoder calls since `pending` was last in step

    def next_token(self, token: int, logprob: float, eot: int) -> int:
        """Take `token`, chosen after `seq` (its log-probability under the rules: `logprob`)
        unless the budget is spent -> the token taken; sets `stop` when done."""
        if len(self.seq) >= self.budget:
            self.stop = "budget"
            return eot
        if token == eot:
            self.stop = "eot"
            return eot
        self.sum_logprob += logprob
        self.logprobs.append(logprob)
        self.seq.append(token)
        drop = repeated_tail(self.seq)
        if drop:
            del self.seq[-drop:], self.logprobs[-drop:]
            self.stop = "repetition"
        elif len(self.seq) >= self.budget:
            self.stop = "budget"
        return token

    def force(self, tokens: list[int]) -> int:
        """Take the draft's forced tokens among `tokens` (those fed this call) -> how many."""
        n = max(0, min(self.options.forced - len(self.seq), len(tokens)))
        self.seq += tokens[:n]
        self.logprobs += [0.0] * n  # (given, not chosen: they weigh nothing in the score)
        self.num_forced += n
        return n

    def resync(self, chosen: int, timestamp_begin: int) -> list[int]:
        """Greedy decoding chose `chosen` -> the draft tokens to feed after it (`resync_draft`;
        none while out of step, and none for good after MAX_MISSES calls out of step)."""
        fed = resync_draft(self.pending, chosen, timestamp_begin)
        if fed is None:
            self.misses += 1
            if self.misses > MAX_MISSES:
                self.pending = []
            return []
        self.pending, self.misses = [], 0
        return fed[: max(0, self.budget - len(self.seq) - 1)]  # within the context

    def result(self, tokenizer: Tokenizer) -> DecodingResult:
        text = tokenizer.decode(self.seq)
        return DecodingResult(
            tokens=self.seq,
            text=text,
            avg_logprob=self.sum_logprob / (len(self.seq) - self.num_forced + 1),
            no_speech_prob=self.no_speech_prob,
            compression_ratio=compression_ratio(text),
            stop=self.stop or "budget",
            temperature=self.options.temperature,
            token_logprobs=self.logprobs,
            speech_heard=self.options.speech_heard,
            given_logprob=self.given_logprob,
        )


def _given_end(options: DecodingOptions, eot: int) -> int | None:
    """The index in the draft of the given text's last text token (the closing mark of the
    sentence a window keeps as context), or None where nothing is given."""
    forced = options.draft[: options.forced]
    return next((k for k in range(len(forced) - 1, -1, -1) if forced[k] < eot), None)


def _given_logprobs(rows: list[_Row], logits: Tensor, starts: list[int], extras: list[int], eot: int) -> None:
    """A first call's logits (wanted positions of every row, `_choices`) -> each row given
    text sets its `given_logprob`: the log-probability of the given text's last token where it
    is fed, the decoder hearing the whole window. A full stop given to a sentence a talker
    paused in is unlikely once the rest of the sentence is heard."""
    at, tokens, owners = [], [], []
    for row, start, extra in zip(rows, starts, extras, strict=True):
        k = _given_end(row.options, eot)
        if k is not None:
            at.append(start + extra - 1 + k)  # the position after the token before it
            tokens.append(row.options.draft[k])
            owners.append(row)
    if at:
        picked = logits[at].log_softmax(dim=-1)  # (G, vocab)
        values = picked.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
        for row, value in zip(owners, values, strict=True):
            row.given_logprob = value


def _choose(rules: LogitRules, rows: list[_Row], logits: Tensor,
            bounds: list[tuple[int, int, int, int]], owners: list[int]) -> tuple[list[int], list[float]]:
    """logits: (R, vocab), position r of row `owners[r]` with the rules `bounds[r]` -> per
    position the token chosen (greedy, or sampled for rows with a temperature) and its
    log-probability, brought to the host together."""
    logprobs, timestamp_first = rules.apply(logits, bounds)  # (R, vocab), (R,)
    tokens = logits.argmax(dim=-1)  # (R,)
    for r, owner in enumerate(owners):
        row = rows[owner]
        if row.generator is not None:
            probs = (logits[r] / row.options.temperature).softmax(-1)
            tokens[r] = torch.multinomial(probs, 1, generator=row.generator)[0]
    ts = rules.ts_begin
    # where text was masked last, a timestamp's log-probability among the timestamps alone
    stamps = logits[:, ts:].log_softmax(dim=-1).gather(1, (tokens - ts).clamp(min=0)[:, None])[:, 0]
    chosen = torch.where(timestamp_first, stamps, logprobs.gather(1, tokens[:, None])[:, 0])  # (R,)
    return tokens.tolist(), chosen.tolist()


def _choices(rules: LogitRules, rows: list[_Row], rests: list[list[int]], extras: list[int],
             active: list[int], num_wanted: list[int]) -> tuple[list[int], list, list[int], list[int]]:
    """A decoder call's wanted positions, row by row (the no-speech one on a first call
    without timestamps, then the one after the token before the row's draft and one after
    each draft token) -> (picks: the positions a token is chosen at, their rules' bounds,
    their rows, each row's first position)."""
    picks, bounds, owners, starts = [], [], [], []
    offset = 0
    for r, n in zip(active, num_wanted, strict=True):
        starts.append(offset)
        picks += range(offset + extras[r] - 1, offset + n)
        bounds += rules.bounds(rows[r].options, rows[r].seq, rests[r])
        owners += [r] * (len(rests[r]) + 1)
        offset += n
    return picks, bounds, owners, starts


RESYNC_TOKENS = 4  # a chosen token found this far into the waiting draft resumes it there
MAX_MISSES = 8  # decoder calls without a match before a row's waiting draft is dropped


def resync_draft(pending: list[int], chosen: int, timestamp_begin: int) -> list[int] | None:
    """Greedy decoding chose `chosen` where the draft has `pending` (not yet agreed) -> the
    draft tokens to feed after `chosen`, or None while the two are out of step:
    - both timestamps (a segment starts or ends a little earlier or later): the draft goes
      on after its timestamp, its later timestamps moved by the difference;
    - `chosen` among the next few draft tokens (the draft had tokens too many, or the
      word before was tokenized differently): the draft goes on after it;
    - else None: greedy produced a word the draft lacks or has another way; the draft waits
      for it to come back in step (a substitution or an insertion).
    """
    if not pending:
        return None
    if chosen >= timestamp_begin and pending[0] >= timestamp_begin:
        return shift_timestamps(pending, chosen - pending[0], timestamp_begin)[1:]
    if chosen in pending[:RESYNC_TOKENS]:
        return pending[pending.index(chosen) + 1 :]
    return None


def _pack(feeds: list[list[int]], num_wanted: list[int], pad: int) -> tuple[Tensor, Tensor, Tensor]:
    """The tokens of one decoder call, left-padded -> (tokens, valid, wanted), each (B, width):
    `valid` where a row has a token, `wanted` at its last `num_wanted` positions, whose
    logits are projected: after the token before the draft and after each draft token (on
    the first call without timestamps also after sot, for no-speech, two tokens before)."""
    width = max(len(feed) for feed in feeds)
    tokens = torch.full((len(feeds), width), pad, dtype=torch.long)
    valid = torch.zeros(len(feeds), width, dtype=torch.bool)
    wanted = torch.zeros(len(feeds), width, dtype=torch.bool)
    for j, (feed, n) in enumerate(zip(feeds, num_wanted, strict=True)):
        tokens[j, width - len(feed) :] = torch.tensor(feed)
        valid[j, width - len(feed) :] = True
        wanted[j, width - n :] = True
    return tokens, valid, wanted


@torch.inference_mode()
def decode_batch(model: Whisper, tokenizer: Tokenizer, audio_features: Tensor,
                 options: list[DecodingOptions], suppress: list[int],
                 stop: Callable[[], bool] | None = None,
                 cross: list[tuple[Tensor, Tensor]] | None = None) -> list[DecodingResult]:
    """audio_features: (B, n_audio_ctx, n_audio_state) -> B sequences decoded together.

    Prompts of different lengths are left-padded; each row keeps its own positions and never
    attends to the padding, so a row decodes as it would alone. A row's draft (the tokens
    greedy decoding is likely to produce) is fed with the token before it; the logit rules
    and greedy choice run over it position by position, so the result is the plain greedy
    one, and every draft token it agrees with saves a decoder call (speculative decoding).
    Where greedy differs, the rejected tokens' keys are dropped; the rest of the draft waits
    until greedy comes back in step with it (`resync_draft`) and is then fed again with the
    chosen token. A row's first `forced` draft tokens are taken as they are (Whisper's prefix:
    text the caller knows the audio holds), at every temperature. Finished rows leave the
    batch (their cache rows are dropped). `stop` is asked before every decoder call; when it
    says so, DecodingCancelled is raised with the finished rows' results and every row's
    tokens so far. `cross`: `cross_kv` of the audio."""
    device = audio_features.device
    eot, ts_begin = tokenizer.eot, tokenizer.timestamp_begin
    rules = LogitRules(tokenizer, suppress, model.dims.n_vocab, device)
    initials = [initial_tokens(tokenizer, o) for o in options]
    rows = [_Row(model, o, len(i), device) for o, i in zip(options, initials, strict=True)]
    rests = [o.draft[: row.budget if o.temperature == 0 else min(o.forced, row.budget)]
             for o, row in zip(options, rows, strict=True)]  # per row: draft tokens fed
    feeds = [i + d for i, d in zip(initials, rests, strict=True)]  # per row: tokens this call
    lengths = [0] * len(rows)  # per row: tokens in its cache (its next position)
    cache = model.decoder.new_cache(cross)
    xa: Tensor | None = audio_features
    active = list(range(len(rows)))  # batch row -> index in `rows`
    first = True
    extras = [1 + (not o.timestamps) for o in options]  # logits before the draft's: first call
    while active:
        if stop is not None and stop():
            raise DecodingCancelled([row.result(tokenizer) if row.stop else None for row in rows],
                                    [list(row.seq) for row in rows])
        num_wanted = [len(rests[r]) + extras[r] for r in active]
        tokens, valid, wanted = _pack([feeds[r] for r in active], num_wanted, eot)
        width = tokens.shape[1]
        ragged = any(len(feeds[r]) != width or rests[r] for r in active)
        hidden = model.decoder.hidden(tokens.to(device), xa, cache,
                                      valid.to(device) if ragged else None)  # (B', width, D)
        logits = model.decoder.logits(hidden[wanted.to(device)], eot + 1, ts_begin)  # (wanted, vocab)
        picks, bounds, owners, starts = _choices(rules, rows, rests, extras, active, num_wanted)
        if first and tokenizer.no_speech >= 0:  # after sot
            no_speech = logits[starts].softmax(-1)[:, tokenizer.no_speech].tolist()
            for r, p in zip(active, no_speech, strict=True):
                rows[r].no_speech_prob = p
        if first:  # (before the rules mask `logits`)
            _given_logprobs(rows, logits, starts, extras, eot)
        choices = logits if len(picks) == logits.shape[0] else logits[picks]  # (R, vocab)
        chosen, chosen_logprobs = _choose(rules, rows, choices, bounds, owners)
        keys_before = cache.num_tokens - width
        offset = 0
        for j, r in enumerate(active):
            row, feed, rest = rows[r], feeds[r], rests[r]
            here = chosen[offset : offset + len(rest) + 1]
            here_logprobs = chosen_logprobs[offset : offset + len(rest) + 1]
            offset += len(rest) + 1
            accepted = row.force(rest)
            token = row.next_token(here[accepted], here_logprobs[accepted], eot)
            while not row.stop and accepted < len(rest) and token == rest[accepted]:
                accepted += 1
                token = row.next_token(here[accepted], here_logprobs[accepted], eot)
            lengths[r] += len(feed) - len(rest) + accepted
            if accepted < len(rest):  # the rest of the draft is not this row's sequence
                rejected = width - len(rest) + accepted  # its index among this call's tokens
                cache.drop_keys(j, keys_before + rejected, lengths[r])
                row.pending = rest[accepted:]
            fed = row.resync(token, ts_begin)
            feeds[r], rests[r] = [token, *fed], fed
        first, xa, extras = False, None, [1] * len(rows)
        keep = [j for j, r in enumerate(active) if not rows[r].stop]
        if len(keep) < len(active):
            if keep:
                cache.select(torch.tensor(keep, device=device))
            active = [active[j] for j in keep]
    return [row.result(tokenizer) for row in rows]
