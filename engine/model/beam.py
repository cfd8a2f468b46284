"""Beam search over one window, as openai/whisper's BeamSearchDecoder and faster-whisper's
default (5 beams, patience 1, candidates ranked by mean log-probability).

Greedy decoding commits to each token as it goes; a word it misreads early steers the rest
of the window's reading. A search keeps the `beam_size` likeliest sequences instead, at a
decoder call per token: offline files always, a live final when the engine has the headroom
(docs/architecture.md, Decoding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.model.decoding import (
    DecodingCancelled,
    DecodingOptions,
    DecodingResult,
    LogitRules,
    compression_ratio,
    initial_tokens,
    repeated_tail,
    token_budget,
)
from engine.model.tokenizer import Tokenizer
from engine.model.whisper import Whisper

BEAM_SIZE = 5
MAX_BEAM_SIZE = 16  # (a setting's bound: each beam is a row of every decoder call)


def check_beam_size(beam_size: int, name: str = "beam_size") -> None:
    """ValueError unless `beam_size` (the setting called `name`) is 1-MAX_BEAM_SIZE."""
    if not 1 <= beam_size <= MAX_BEAM_SIZE:
        raise ValueError(f"{name} must be 1-{MAX_BEAM_SIZE}, got {beam_size}")


@dataclass
class _Beam:
    """One sequence: its tokens, their log-probabilities and how it stopped (when it did)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    score: float = 0.0  # the sum of `logprobs`, with end-of-text's where it ended so
    stop: str = ""

    def extend(self, token: int, logprob: float, eot: int, budget: int) -> _Beam:
        """This sequence with `token` after it (a new one; `stop` set if that ends it)."""
        if token == eot:
            return _Beam(self.tokens, self.logprobs, self.score + logprob, "eot")
        beam = _Beam([*self.tokens, token], [*self.logprobs, logprob], self.score + logprob)
        drop = repeated_tail(beam.tokens)
        if drop:  # a loop: its copies dropped, as greedy decoding drops them
            beam.tokens, beam.logprobs, beam.stop = beam.tokens[:-drop], beam.logprobs[:-drop], "repetition"
        elif len(beam.tokens) >= budget:
            beam.stop = "budget"
        return beam

    def rank(self, forced: int) -> float:
        """Whisper's MaximumLikelihoodRanker without a length penalty: the mean over the
        tokens after the `forced` ones."""
        return self.score / max(len(self.tokens) - forced, 1)


@torch.inference_mode()
def decode_beam(model: Whisper, tokenizer: Tokenizer, audio_features: Tensor,
                cross: list[tuple[Tensor, Tensor]], options: DecodingOptions, suppress: list[int],
                beam_size: int = BEAM_SIZE, stop: Callable[[], bool] | None = None) -> DecodingResult:
    """audio_features: (1, n_audio_ctx, n_state) one window; cross: its `cross_kv` -> the
    likeliest of `beam_size` finished sequences under the same logit rules as greedy
    decoding. Each step extends every live beam by its `beam_size + 1` likeliest tokens and
    keeps the `beam_size` likeliest unfinished sequences; it ends once `beam_size` have
    finished (end-of-text, the budget, a loop), or none is left. The draft's first `forced`
    tokens start every beam (Whisper's prefix), weighing nothing; the rest of the draft is
    not used. `stop` is asked before every decoder call; when it says so,
    DecodingCancelled is raised (the caller keeps its greedy decode)."""
    assert options.temperature == 0.0
    device, eot = audio_features.device, tokenizer.eot
    rules = LogitRules(tokenizer, suppress, model.dims.n_vocab, device)
    initial = initial_tokens(tokenizer, options)
    budget = token_budget(options.audio_seconds, model.dims.n_text_ctx, len(initial))
    forced = options.draft[: min(options.forced, budget - 1)]
    if stop is not None and stop():
        raise DecodingCancelled()
    cache = model.decoder.new_cache(cross)
    hidden = model.decoder.hidden(torch.tensor([initial + forced], device=device), audio_features,
                                  cache)  # (1, T, D)
    # the no-speech probability after the start of transcript (or no-timestamps), as decode_batch
    sot = hidden.shape[1] - len(forced) - 1 - (not options.timestamps)
    wanted = [sot, hidden.shape[1] - 1]
    logits = model.decoder.logits(hidden[0, wanted], eot + 1, tokenizer.timestamp_begin)  # (2, vocab)
    no_speech = logits[0].softmax(-1)[tokenizer.no_speech].item() if tokenizer.no_speech >= 0 else 0.0
    logits = logits[-1:]
    live, finished = [_Beam(list(forced), [0.0] * len(forced))], []
    while live:
        rules.apply(logits, [rules.bounds(options, b.tokens, [])[0] for b in live])
        top = logits.log_softmax(dim=-1).topk(beam_size + 1, dim=-1)  # (live, beam + 1)
        candidates = [(b.extend(t, p, eot, budget), i) for i, b in enumerate(live)
                      for p, t in zip(top.values[i].tolist(), top.indices[i].tolist(), strict=True)
                      if p > -float("inf")]
        candidates.sort(key=lambda c: c[0].score, reverse=True)
        kept, sources, done = [], [], []
        for beam, source in candidates:
            if beam.stop:
                done.append(beam)
            else:
                kept.append(beam)
                sources.append(source)
                if len(kept) == beam_size:
                    break
        finished += done[: beam_size - len(finished)]
        if len(finished) >= beam_size or not kept:
            break
        if stop is not None and stop():
            raise DecodingCancelled()
        cache.select(torch.tensor(sources, device=device))  # (the window's cross keys stay shared)
        live = kept
        tokens = torch.tensor([[b.tokens[-1]] for b in live], device=device)
        logits = model.decoder.logits(model.decoder.hidden(tokens, None, cache)[:, -1], eot + 1,
                                      tokenizer.timestamp_begin)  # (live, vocab)
    best = max(finished or live, key=lambda b: b.rank(len(forced)))
    text = tokenizer.decode(best.tokens)
    return DecodingResult(tokens=best.tokens, text=text,
                          avg_logprob=best.score / (len(best.tokens) - len(forced) + 1),
                          no_speech_prob=no_speech, compression_ratio=compression_ratio(text),
                          stop=best.stop or "budget", token_logprobs=best.logprobs,
                          speech_heard=options.speech_heard)
