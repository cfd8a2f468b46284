"""Transcribe what a dead server left in the spool into the store, at the next start.

A session's spool (app/spool.py) holds its audio from a little before the end of its stored
transcript. Recovery goes on from that end (`TranscriptStore.covered_ms`): the spooled audio
after it is transcribed through the engine as a background request (like a pre-recorded
file: live sessions come first), and the words are appended to the session's JSONL file as
records with `"recovered": true`, then the spool folder is deleted. A server that dies again
meanwhile goes on from the last recovered record at its next start: every spooled second
gets into the store once.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from app.session import ServerContext, text_of, words_json
from app.spool import Leftover
from app.upload import PIECE_S, transcribe_pieces
from audio.io import SAMPLE_RATE
from engine.words import Word

log = logging.getLogger(__name__)


def _shifted(words: list[Word], offset_ms: int) -> list[Word]:
    return [replace(w, start_ms=w.start_ms + offset_ms, end_ms=w.end_ms + offset_ms) for w in words]


async def recover_session(ctx: ServerContext, leftover: Leftover) -> float:
    """Transcribe one leftover spool into the store, then delete it -> seconds recovered."""
    store, session_id = ctx.store, leftover.session_id
    covered_ms = store.covered_ms(session_id)
    start = max(covered_ms * SAMPLE_RATE // 1000, leftover.first_sample())
    end = leftover.num_samples()
    if end > start:
        offset_ms = start * 1000 // SAMPLE_RATE

        async def on_words(words: list[Word]) -> None:
            words = _shifted(words, offset_ms)
            store.append(session_id, {"text": text_of(words), "start_ms": words[0].start_ms,
                                      "end_ms": words[-1].end_ms, "words": words_json(words),
                                      "recovered": True})

        pieces = leftover.read(start, int(PIECE_S * SAMPLE_RATE))
        await transcribe_pieces(ctx, pieces, on_words, ctx.metrics.recovered_audio_seconds.inc)
    if not store.close(session_id):
        log.error("recovery of %s: its transcript could not be stored; the spool is kept", session_id)
        return 0.0
    leftover.remove()
    return max(0, end - start) / SAMPLE_RATE


async def recover(ctx: ServerContext, leftovers: list[Leftover]) -> None:
    """Recover leftover spools (Spool.leftovers), one after another."""
    if not leftovers:
        return
    log.info("recovering %d sessions a previous run left unfinished", len(leftovers))
    for leftover in leftovers:
        try:
            seconds = await recover_session(ctx, leftover)
        except Exception:
            log.exception("recovery of %s failed; its spool is kept for the next start",
                          leftover.session_id)
            continue
        log.info("recovered %s: %.1f s of audio transcribed into the store", leftover.session_id, seconds)
