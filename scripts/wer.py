"""Word error rate on normalized English text (case, punctuation and numbers folded)."""

from __future__ import annotations

import re

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
        "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
ABBREVIATIONS = {"mr": "mister", "mrs": "missus", "dr": "doctor", "st": "saint"}


def number_words(n: int) -> list[str]:
    if n < 20:
        return [ONES[n]]
    if n < 100:
        return [TENS[n // 10]] + ([ONES[n % 10]] if n % 10 else [])
    if n < 1000:
        return [ONES[n // 100], "hundred"] + (number_words(n % 100) if n % 100 else [])
    return [str(n)]


def normalize(text: str) -> list[str]:
    """'Mr. Dashwood, 10 of clubs!' -> ['mister', 'dashwood', 'ten', 'of', 'clubs']."""
    text = re.sub(r"<[^>]*>|\[[^\]]*\]", " ", text.lower())
    text = re.sub(r"[-‐–—_/]", " ", text)
    text = re.sub(r"[^\w\s']", " ", text)
    words: list[str] = []
    for word in text.split():
        word = word.strip("'")
        if not word:
            continue
        if word.isdigit():
            words.extend(number_words(int(word)))
        else:
            words.append(ABBREVIATIONS.get(word, word))
    return words


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """-> (edit distance in words, number of reference words)."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    return edit_distance(ref, hyp), len(ref)


def wer(reference: str, hypothesis: str) -> float:
    errors, n = word_errors(reference, hypothesis)
    return errors / max(n, 1)
