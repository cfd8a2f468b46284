"""Evaluation corpus, built at run time: speech with known text, onsets and gaps, under conditions.

Sources (nothing is downloaded): espeak-ng in many voices and variants, rates and pitches; Debian's
flite voices (kal, kal16, awb, rms, slt); Debian's festival voices (the slt HTS voice, the kal
and ked diphone voices), a TTS engine the rest of the corpus does not use; the real
recordings of pocketsphinx-testdata (the Sense and Sensibility passages, the card phrases,
"go forward ten meters") and of asterisk-core-sounds-en-wav (Asterisk's English prompts,
their texts in asterisk-core-sounds-en). The TTS speaks the passages below, written for this corpus. Every
piece is trimmed to its speech (an energy threshold on 10 ms frames) and brought to the same
speech level, then placed at known sample positions, so each sentence's onset and end are
exact.

Conditions (each a WAV file, or several, with a JSON manifest beside it):
- level-0 / level-20 / level-30 / level-50: one program (many voices, real recordings) at
  speech level -23 dBFS, and scaled by -20, -30 and -50 dB;
- level-drop: the program at -23 dBFS for its first third, then 40 dB down from a pause on (a
  far talker after a near one);
- pink-snr20 / pink-snr10 / white-snr20 / white-snr10: the same program with noise throughout;
- babble-snr12: the program with three other voices talking under it, 12 dB down;
- reverb: the program in a room (a 0.5 s reverberation tail, as loud as the direct sound);
- cheap-mic: the program 40 dB down on a DC offset of 1% of full scale, with a click near full
  scale before it and in one pause in four;
- hot-mic: the program 20 dB up (-3 dBFS speech before clipping), clipped at full scale;
- telephone-8k: the program band-passed to 300-3400 Hz, written at 8 kHz;
- stereo-44k: the program at 44.1 kHz in two channels (the right one 2 dB quieter);
- gaps-silence / gaps-noise: sentences with gaps of 5-60 s of digital silence, or with a
  -60 dBFS pink noise floor throughout;
- pauses-short / run-on: passages, one voice each, with 0.12-0.35 s between sentences, or
  0.03-0.08 s (sentences run on with no pause a VAD can hear);
- hesitant: passages, one espeak-ng voice each, every sentence stopping once or twice for
  0.3-1.5 s at a seeded word boundary (an SSML break: a talker who stops to think), 0.6-1.2 s
  between sentences: pauses inside sentences, as long as those between them;
- festival / festival-pink-snr10: the program's TTS sentences read by festival voices (a voice
  per sentence, 0.6-1.2 s pauses), clean and with pink noise 10 dB under the speech;
- long-session: over 10 minutes of passages, one voice per passage, 1.5 s between sentences;
- end-abrupt: short clips whose file ends within 50 ms after the last word;
- previous-set: the recordings of the earlier evaluation set (the Austen passages once and in
  two repeated orders, the card phrases, three espeak passages), trimmed and re-joined;
- real-ivr: telephone prompts recorded by a voice talent at 8 kHz (Debian's
  asterisk-core-sounds-en-wav), 0.6-1.2 s pauses: a real speaker outside the TTS.

A manifest holds the file's rate and channels, its speech level and noise, every sentence
(text, onset, end in seconds, speaker) and every gap between them and at both ends (start, end,
kind "silence", "noise", "reverb" (the tail of the speech before it) or "offset" (a DC offset
and clicks); noise_dbfs). Seeded: the same seed builds the same files.

    scripts/dev.sh run python scripts/corpus.py [--out data/corpus] [--quick] [--seeds 0 ...] \
        [--conditions hesitant ...]

The second half of this module scores a transcript with word times against a manifest: the
alignment of normalized words, the longest dropped passage, words placed inside long gaps and
the sentence-onset errors (scripts/evaluate.py reports them).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.wer import normalize  # noqa: E402

VERSION = 11  # bump when the corpus changes: evaluate.py rebuilds an older one
DEFAULT_DIR = ROOT / "data" / "corpus"
RATE = 16000
SPEECH_DBFS = -23.0  # every piece's speech level (RMS over its active frames) at level 0
PEAK_LIMIT = 0.9  # a piece is turned down until its peak is under this
TESTDATA = Path("/usr/share/pocketsphinx/test/data")
AUSTEN = ["0870", "0880", "0890", "0920", "0930"]
ASTERISK = Path("/usr/share/asterisk/sounds/en_US_f_Allison")
ASTERISK_TEXTS = Path("/usr/share/doc/asterisk-core-sounds-en/core-sounds-en.txt.gz")
# Passages for the TTS voices, written for this corpus: five sentences each on one topic, 6-25
# words, plain words with no spelling variants (no harbour/harbor), few numbers.
PASSAGES: tuple[tuple[str, ...], ...] = (
    ("Fresh bread needs flour, water, salt and a little yeast.",
     "Mix everything in a large bowl until the dough feels soft and slightly sticky.",
     "Leave it covered in a warm place for about an hour, until it has doubled in size.",
     "Then shape the loaf, put it on a tray and bake it until the crust is golden brown.",
     "Let it cool before you cut it, or the inside will be heavy and wet."),
    ("The morning train left the station just after sunrise.",
     "Most of the passengers were reading newspapers or sleeping with their heads against the window.",
     "Outside, the fields were covered in a thin layer of frost that sparkled in the light.",
     "A young woman with a violin case sat near the door and watched the small villages pass by.",
     "When the conductor announced the next stop, half of the carriage stood up at once."),
    ("By the middle of spring the garden was full of life again.",
     "Tulips opened along the path, and the apple tree was covered in white blossom.",
     "My grandmother spent every afternoon pulling weeds and talking quietly to her plants.",
     "She said that tomatoes grow better when someone pays attention to them.",
     "Nobody believed her, but her tomatoes were always the best in the street."),
    ("Honey bees tell each other where to find food by dancing.",
     "A worker that has found flowers returns to the hive and moves in a figure of eight.",
     "The angle of the dance shows the direction of the flowers compared with the sun.",
     "The length of the waggle tells the other bees how far they need to fly.",
     "Scientists needed many years of patient watching to understand this remarkable language."),
    ("The meeting started late because the projector would not turn on.",
     "While someone went to find a cable, the manager asked everyone to share their news.",
     "The design team had finished the new website, and the sales team had signed two large customers.",
     "Everyone agreed that the office kitchen needed a bigger fridge.",
     "By the time the projector finally worked, there was almost nothing left to discuss."),
    ("We started the climb before dawn, carrying our boots in our hands across the cold stream.",
     "The path rose steeply through the pine forest and then out onto open rock.",
     "Near the top the wind was so strong that we had to hold on to each other.",
     "From the summit we could see the whole valley, with the river shining like a thread of silver.",
     "Going down was harder on the knees than going up had been."),
    ("The museum keeps its oldest maps in a dark room at the back of the building.",
     "Light and moisture slowly destroy paper, so the visitors may only look at them through glass.",
     "One of the maps shows the coast as sailors imagined it several hundred years ago.",
     "Whole islands are missing, and a large sea monster swims where the ocean is deepest.",
     "Children usually spend more time looking at the monster than at anything else."),
    ("Autumn arrived early this year, with cold nights and bright, clear mornings.",
     "The leaves turned yellow and red within a single week.",
     "Farmers hurried to bring in the last of the harvest before the heavy rain came.",
     "In the evenings people lit their fires and closed the curtains earlier than usual.",
     "The first snow fell on the hills before anyone had expected it."),
    ("When I was a child, we spent every summer in a small cabin beside a lake.",
     "There was no electricity, so we cooked on a wood stove and read by the light of oil lamps.",
     "My brother and I swam from morning until evening and caught tiny fish with our hands.",
     "At night we lay on the wooden dock and counted shooting stars.",
     "I still remember the sound of the water against the boat."),
    ("My laptop had become so slow that opening a single document took several minutes.",
     "A friend suggested that I check how much space was left on the disk.",
     "It turned out to be almost completely full of old photos and forgotten downloads.",
     "After I moved the photos to an external drive, everything ran smoothly again.",
     "Now I clean up my files at the end of every month."),
    ("On market day the town square fills with stalls long before the shops open.",
     "Farmers sell cheese, eggs, honey and vegetables that were picked the evening before.",
     "There is always a man selling knives who shows how sharp they are by cutting paper in the air.",
     "The smell of roasted nuts and fresh coffee drifts across the whole square.",
     "By noon the best things are gone, and the sellers start to pack away their tables."),
    ("The lighthouse keeper climbed the narrow stairs every evening to light the lamp.",
     "He cleaned the glass carefully, because even a little dust could dim the beam.",
     "On stormy nights he stayed awake until morning, watching the ships pass the dangerous rocks.",
     "Once he saw a small boat in trouble and rowed out alone to help the fishermen.",
     "They thanked him with a basket of fish that lasted him a whole week."),
    ("Most adults need between seven and nine hours of sleep every night.",
     "Going to bed at the same time each evening helps the body settle into a rhythm.",
     "Bright screens late at night can make it harder to fall asleep.",
     "A cool, dark and quiet bedroom is best for deep rest.",
     "If sleep does not come, it often helps to get up and read for a while."),
    ("My first piano teacher was a patient old man with very large hands.",
     "He made me play scales slowly, again and again, until every note sounded the same.",
     "I hated those lessons at the time and wanted to play real songs instead.",
     "Years later I understood that the boring exercises had given me control over my fingers.",
     "Now I make my own students practice scales, and they hate it just as much as I did."),
    ("The old stone bridge was built by hand without any modern machines.",
     "Workers carried every block from a quarry on the other side of the hill.",
     "It has survived floods, wars and centuries of heavy traffic.",
     "Today only people on foot and bicycles are allowed to cross it.",
     "In the summer, couples stop in the middle to take photographs of the sunset over the river."),
    ("A good vegetable soup begins with onions cooked slowly in butter.",
     "Add carrots, celery and potatoes, and let them soften for a few minutes.",
     "Pour in enough stock to cover everything and let it simmer gently.",
     "A handful of fresh herbs at the end makes a surprising difference to the flavor.",
     "Serve it hot with thick slices of bread and a little cheese on the side."),
    ("Far from the city lights, the night sky is crowded with stars.",
     "The band of the Milky Way stretches across the sky like a pale cloud.",
     "With a small telescope you can see the rings of Saturn and the moons of Jupiter.",
     "The planets do not twinkle the way stars do, which is one way to tell them apart.",
     "On a clear night it is easy to lose track of time while looking up."),
    ("The match was tied for most of the afternoon.",
     "Both teams played carefully, afraid of making the mistake that would cost them the game.",
     "Then, in the last minutes, a young striker ran past three defenders and shot from the edge of the box.",
     "The ball hit the post and bounced into the net.",
     "The crowd was so loud that nobody heard the final whistle."),
    ("Moving to a new house is always more work than you expect.",
     "We spent weeks packing books, dishes and clothes into cardboard boxes.",
     "On the day of the move it rained without stopping, and the truck arrived late.",
     "By evening our furniture was inside, but nobody could remember which box held the kettle.",
     "We ate cold sandwiches on the floor and laughed about it."),
    ("Our flight was delayed because of fog at the airport.",
     "At first the screens said one hour, then two, and then they simply said later.",
     "Families spread out on the floor, and children ran up and down the long hall.",
     "A kind woman at the information desk handed out free bottles of water.",
     "We finally took off just before midnight, tired but glad to be moving."),
    ("In the painting class we were asked to paint a bowl of fruit.",
     "It sounds simple, but the light on an apple changes with every movement of the clouds.",
     "The teacher told us to look at the shadows instead of the fruit itself.",
     "My first attempt looked more like a pile of stones than a bowl of apples.",
     "By the end of the course I was quite proud of a small painting of pears."),
    ("On the farm the day begins long before sunrise.",
     "The cows must be milked, the chickens fed and the eggs collected from the barn.",
     "After breakfast the farmer checks the fences and the water troughs in every field.",
     "In the afternoon there is always something to repair, from a broken gate to a leaking roof.",
     "Nobody on a farm ever complains of being bored."),
    ("The little coffee shop on the corner opened three years ago.",
     "Its owner roasts the beans herself in a small machine behind the counter.",
     "Regular customers have their own cups hanging on hooks along the wall.",
     "On quiet mornings she teaches students how to draw patterns in the milk foam.",
     "The shop is busy all day, even though it has only six tables."),
    ("The rain forest is home to more kinds of animals than any other place on land.",
     "Monkeys swing through the high branches while colorful birds call to each other.",
     "On the ground, ants march in long lines carrying pieces of leaves many times their size.",
     "Some frogs are so brightly colored that they warn every hunter to stay away.",
     "Many of the creatures that live there have never been studied."),
    ("Learning a new language as an adult takes patience and a sense of humor.",
     "At first every conversation feels like a test that you are about to fail.",
     "It helps to listen to the radio and to read simple stories written for children.",
     "Making mistakes in public is embarrassing, but it is also the fastest way to learn.",
     "One day you suddenly notice that you are dreaming in the new language."),
    ("The storm arrived in the middle of the night and knocked out the power across the whole town.",
     "We found candles in the kitchen drawer and gathered in the living room.",
     "The wind howled around the house, and the old trees creaked in the dark.",
     "In the morning the roads were blocked by fallen branches and deep snow.",
     "The neighbors came out with shovels, and by lunchtime the street was clear again."),
    ("A flat tire is the most common problem for anyone who rides a bicycle.",
     "First remove the wheel and let out any air that remains in the tube.",
     "Use two plastic levers to lift the edge of the tire away from the rim.",
     "Find the hole by pumping a little air into the tube and listening for the hiss.",
     "A small patch and some glue will usually fix it in a few minutes."),
    ("The waiting room at the clinic was quiet except for the sound of the clock.",
     "A nurse called each name in turn and led the patients down a long corridor.",
     "The doctor listened carefully, asked a few questions and checked my blood pressure.",
     "She told me to rest for a week and to drink plenty of water.",
     "I left feeling better already, just from being taken seriously."),
    ("Our dog disappeared one evening when someone left the garden gate open.",
     "We searched the streets until it was dark, calling his name and shaking his food bowl.",
     "The next morning we put up posters on every lamp post in the neighborhood.",
     "Two days later a farmer phoned to say that a friendly dog was sleeping in his barn.",
     "When we arrived, our dog wagged his tail as if nothing had happened."),
    ("The city plans to close the main street to cars on weekends.",
     "Supporters say that people will walk more and that the small shops will attract new customers.",
     "Some drivers worry that the traffic will simply move to the narrow streets nearby.",
     "The council has promised more buses and a new bicycle lane along the river.",
     "A trial will begin in the spring, and residents will vote on it at the end of the year."),
)

# The espeak-ng passages of the earlier evaluation set (en-us, 150 words a minute), kept as they were.
PREVIOUS_PASSAGES = {
    "espeak-harbour": (
        "The harbour was quiet in the early morning. A few boats rocked gently against the "
        "wooden pier, and the smell of salt and tar hung in the cold air. An old fisherman "
        "sat on an upturned crate, mending a net with slow and careful hands. He had done "
        "this work for most of his life, and he did not need to look at the knots any more."),
    "espeak-library": (
        "The library opens at nine and closes at six on weekdays. Visitors may borrow up to "
        "five books at a time, and each loan lasts three weeks. Please return books to the "
        "desk near the main entrance. Quiet study rooms can be booked at the front counter, "
        "and the reading room on the second floor is open to everyone."),
    "espeak-weather": (
        "Tomorrow will start cloudy with a chance of light rain in the north. By the "
        "afternoon the clouds should clear from the west, and temperatures will rise to "
        "around twenty degrees. The wind will be light, turning stronger near the coast in "
        "the evening. The weekend looks dry and bright across most of the country."),
}
ESPEAK_VOICES = ["en", "en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan",
                 "en-gb-x-gbcwmd", "en-us-nyc"]
ESPEAK_VARIANTS = ["", "f1", "f2", "f3", "f4", "m1", "m2", "m3", "m4", "m5", "m6", "m7"]
FLITE_VOICES = ["kal", "kal16", "awb", "rms", "slt"]
FESTIVAL_VOICES = ["cmu_us_slt_arctic_hts", "kal_diphone", "ked_diphone"]
# the Debian packages of each synthesizer (festival's voices are packages of their own)
PACKAGES = {"espeak-ng": "espeak-ng", "flite": "flite",
            "text2wave": "festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts"}


# ---------------------------------------------------------------------------------------------
# Pieces: one utterance each, trimmed to its speech and levelled


@dataclass(frozen=True)
class Voice:
    engine: str  # "espeak", "flite" or "festival"
    name: str  # espeak voice with its +variant, or the flite or festival voice
    rate: int  # espeak: words per minute; flite: duration stretch in percent; festival: unused
    pitch: int = 50  # espeak only (0-99)

    @property
    def label(self) -> str:
        if self.engine == "flite":
            return f"flite:{self.name} x{self.rate / 100:.2f}"
        if self.engine == "festival":
            return f"festival:{self.name}"
        return f"espeak:{self.name} s{self.rate} p{self.pitch}"


@dataclass
class Piece:
    text: str
    samples: np.ndarray  # (n,) float32 16 kHz, speech from the first sample to the last
    speaker: str


def random_voice(rng: random.Random) -> Voice:
    if rng.random() < 0.3:
        return Voice("flite", rng.choice(FLITE_VOICES), rng.randrange(85, 121))
    return espeak_voice(rng)


def espeak_voice(rng: random.Random) -> Voice:
    variant = rng.choice(ESPEAK_VARIANTS)
    name = rng.choice(ESPEAK_VOICES) + (f"+{variant}" if variant else "")
    return Voice("espeak", name, rng.randrange(130, 201), rng.randrange(30, 71))


def synthesize(text: str, voice: Voice, ssml: bool = False) -> np.ndarray:
    """Text -> (n,) float32 16 kHz, as the voice speaks it (espeak-ng, flite or festival's
    text2wave by subprocess; `ssml`: the text is SSML, espeak-ng only)."""
    with tempfile.TemporaryDirectory() as folder:
        path, stdin = Path(folder) / "out.wav", None
        if voice.engine == "espeak":
            command = ["espeak-ng", *(["-m"] if ssml else []), "-v", voice.name, "-s", str(voice.rate),
                       "-p", str(voice.pitch), "-w", str(path), text]
        elif voice.engine == "festival":
            command, stdin = ["text2wave", "-eval", f"(voice_{voice.name})", "-o", str(path)], text.encode()
        else:
            command = ["flite", "-voice", voice.name, "--setf",
                       f"duration_stretch={voice.rate / 100}", "-t", text, "-o", str(path)]
        if shutil.which(command[0]) is None:
            raise RuntimeError(f"{command[0]} is not installed: apt-get install {PACKAGES[command[0]]}")
        subprocess.run(command, input=stdin, check=True, capture_output=True)
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    return to_rate(data.mean(axis=1), rate, RATE)


def to_rate(samples: np.ndarray, rate: int, new_rate: int) -> np.ndarray:
    if rate == new_rate:
        return samples.astype(np.float32)
    g = np.gcd(rate, new_rate)
    return AF.resample(torch.from_numpy(np.ascontiguousarray(samples, np.float32)), rate // g,
                       new_rate // g).numpy()


def frame_db(samples: np.ndarray, frame: int = RATE // 100) -> np.ndarray:
    """RMS level in dBFS of each 10 ms frame."""
    n = samples.size // frame
    frames = samples[: n * frame].reshape(n, frame).astype(np.float64)
    return 10 * np.log10(np.mean(frames**2, axis=1) + 1e-20)


def speech_bounds(samples: np.ndarray, noisy: bool = False) -> tuple[int, int]:
    """-> (first, end) sample of the speech: the first and last run of 30 ms whose 10 ms frames
    are all over the threshold (40 dB under the loudest frame; for a recording with a noise
    floor, `noisy`, 10 dB over its 20th percentile frame when that is higher), 10 ms of margin."""
    db = frame_db(samples)
    threshold = db.max() - 40
    if noisy:
        threshold = max(threshold, float(np.percentile(db, 20)) + 10)
    loud = np.convolve(db > threshold, np.ones(3), mode="valid") == 3  # runs of 3 frames
    runs = np.flatnonzero(loud)
    if runs.size == 0:
        raise ValueError("no speech found")
    frame = RATE // 100
    first, last = max(0, (runs[0] - 1) * frame), min(samples.size, (runs[-1] + 4) * frame)
    return int(first), int(last)


def make_piece(samples: np.ndarray, text: str, speaker: str, noisy: bool = False) -> Piece:
    """Trim to the speech (5 ms fades), bring the active frames to SPEECH_DBFS."""
    first, end = speech_bounds(samples, noisy)
    x = samples[first:end].astype(np.float64)
    fade = np.linspace(0.0, 1.0, RATE // 200)
    x[: fade.size] *= fade
    x[-fade.size :] *= fade[::-1]
    db = frame_db(x)
    active = db[db > db.max() - 40]
    gain = 10 ** ((SPEECH_DBFS - 10 * np.log10(np.mean(10 ** (active / 10)))) / 20)
    gain = min(gain, PEAK_LIMIT / np.abs(x).max())
    return Piece(text, (x * gain).astype(np.float32), speaker)


def tts_piece(text: str, voice: Voice) -> Piece:
    return make_piece(synthesize(text, voice), text, voice.label)


def recording_piece(path: Path, text: str) -> Piece:
    if path.suffix == ".raw":  # 16 kHz PCM16 mono without a header
        samples = np.fromfile(path, dtype="<i2").astype(np.float32) / 32768.0
    else:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
        samples = to_rate(data.mean(axis=1), rate, RATE)
    return make_piece(samples, text, f"recording:{path.stem}", noisy=True)


# ---------------------------------------------------------------------------------------------
# Clips: pieces placed at known positions, then a condition applied to the whole


@dataclass
class Clip:
    name: str
    condition: str
    audio: np.ndarray  # (n,) mono or (n, channels) float32 at `rate`
    rate: int
    sentences: list[dict]  # text, onset, end (seconds), speaker
    # start, end (seconds), kind ("silence", "noise", "reverb", "offset", "sound"), noise_dbfs
    gaps: list[dict]
    info: dict = field(default_factory=dict)  # speech_dbfs, gain_db, noise


def layout(name: str, condition: str, pieces: list[Piece], pauses: list[float],
           lead: float = 0.5, tail: float = 1.0) -> Clip:
    """Pieces in order with `pauses[i]` seconds of digital silence after piece i (one fewer
    than the pieces), `lead` before the first and `tail` after the last."""
    assert len(pauses) == len(pieces) - 1
    gaps_n = [round(lead * RATE)] + [round(p * RATE) for p in pauses] + [round(tail * RATE)]
    audio = np.zeros(sum(gaps_n) + sum(p.samples.size for p in pieces), np.float32)
    sentences, gaps, at = [], [], 0
    for i, piece in enumerate(pieces):
        gaps.append((at, at + gaps_n[i]))
        at += gaps_n[i]
        audio[at : at + piece.samples.size] = piece.samples
        sentences.append({"text": piece.text, "onset": at / RATE, "end": (at + piece.samples.size) / RATE,
                          "speaker": piece.speaker})
        at += piece.samples.size
    gaps.append((at, at + gaps_n[-1]))
    gap_rows = [{"start": a / RATE, "end": b / RATE, "kind": "silence", "noise_dbfs": None}
                for a, b in gaps if b > a]
    return Clip(name, condition, audio, RATE, sentences, gap_rows,
                {"speech_dbfs": SPEECH_DBFS, "gain_db": 0.0, "noise": None})


def with_gain(clip: Clip, name: str, db: float) -> Clip:
    gain = 10 ** (db / 20)
    gaps = [{**g, "noise_dbfs": None if g["noise_dbfs"] is None else g["noise_dbfs"] + db}
            for g in clip.gaps]
    info = {**clip.info, "speech_dbfs": clip.info["speech_dbfs"] + db, "gain_db": clip.info["gain_db"] + db}
    return Clip(name, name, (clip.audio * gain).astype(np.float32), clip.rate, clip.sentences, gaps, info)


def with_drop(clip: Clip, name: str, db: float) -> Clip:
    """The clip as it is up to the pause before its first sentence past a third of it, then
    `db` down from the middle of that pause on: a far talker after a near one."""
    i = next(k for k, s in enumerate(clip.sentences) if s["onset"] >= clip.audio.shape[0] / clip.rate / 3)
    at = (clip.sentences[i - 1]["end"] + clip.sentences[i]["onset"]) / 2
    audio = clip.audio.copy()
    audio[round(at * clip.rate) :] *= 10 ** (db / 20)
    gaps = [{**g, "noise_dbfs": None if g["noise_dbfs"] is None or g["start"] < at else g["noise_dbfs"] + db}
            for g in clip.gaps]
    info = {**clip.info, "drop": {"at": round(at, 4), "db": db, "first_sentence": i}}
    return Clip(name, name, audio, clip.rate, clip.sentences, gaps, info)


def noise(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n,) white or pink (1/f power) Gaussian noise at unit RMS."""
    x = rng.standard_normal(n)
    if kind == "pink":
        spectrum = np.fft.rfft(x)
        spectrum[1:] /= np.sqrt(np.arange(1, spectrum.size))
        spectrum[0] = 0
        x = np.fft.irfft(spectrum, n)
    return x / np.sqrt(np.mean(x**2))


def with_noise(clip: Clip, name: str, kind: str, dbfs: float, seed: int) -> Clip:
    """Noise throughout the clip at `dbfs` RMS; the gaps become noise gaps."""
    rng = np.random.default_rng(seed + zlib.crc32(name.encode()))
    audio = clip.audio + 10 ** (dbfs / 20) * noise(kind, clip.audio.size, rng)
    gaps = [{**g, "kind": "noise", "noise_dbfs": dbfs} for g in clip.gaps]
    info = {**clip.info, "noise": {"kind": kind, "dbfs": dbfs,
                                   "snr_db": round(clip.info["speech_dbfs"] - dbfs, 3)}}
    return Clip(name, name, audio.astype(np.float32), clip.rate, clip.sentences, gaps, info)


def with_babble(clip: Clip, name: str, snr_db: float, seed: int, talkers: int = 3) -> Clip:
    """Other people talking under the speech throughout (a cafe, a television): `talkers` TTS
    voices, each reading a passage the clip does not hold, looped from a seeded point, together
    `snr_db` under the speech. Unlike noise, the VAD hears speech in every pause."""
    rng = voices_rng(seed, name)
    babble = np.zeros(clip.audio.size)
    for k in range(talkers):
        voice = random_voice(rng)
        talk = np.concatenate([tts_piece(t, voice).samples for t in PASSAGES[-1 - k]])
        talk = np.tile(talk, -(-babble.size // talk.size))[: babble.size]
        babble += np.roll(talk, rng.randrange(talk.size))
    dbfs = clip.info["speech_dbfs"] - snr_db
    audio = clip.audio + 10 ** (dbfs / 20) * babble / np.sqrt(np.mean(babble**2))
    gaps = [{**g, "kind": "noise", "noise_dbfs": dbfs} for g in clip.gaps]
    info = {**clip.info, "noise": {"kind": "babble", "dbfs": dbfs, "snr_db": snr_db, "talkers": talkers}}
    return Clip(name, name, audio.astype(np.float32), clip.rate, clip.sentences, gaps, info)


def reverberant(clip: Clip, name: str, rt60: float, seed: int, drr_db: float = 0.0) -> Clip:
    """The clip in a room: its direct sound plus a diffuse tail (seeded Gaussian noise that
    decays by 60 dB in `rt60` s), `drr_db` direct-to-reverberant energy ratio, the speech level
    kept. The tail fills the pauses between sentences."""
    rng = np.random.default_rng(seed + zlib.crc32(name.encode()))
    t = np.arange(1, round(rt60 * clip.rate)) / clip.rate
    tail = rng.standard_normal(t.size) * np.exp(-3 * np.log(10) * t / rt60)
    tail *= 10 ** (-drr_db / 20) / np.sqrt(np.sum(tail**2))
    response = torch.from_numpy(np.concatenate([[1.0], tail]))
    wet = AF.fftconvolve(torch.from_numpy(clip.audio.astype(np.float64)), response)[: clip.audio.size].numpy()
    wet *= np.sqrt(np.mean(clip.audio**2) / np.mean(wet**2))
    gaps = [{**g, "kind": "reverb"} for g in clip.gaps]
    return Clip(name, name, wet.astype(np.float32), clip.rate, clip.sentences, gaps,
                {**clip.info, "rt60_s": rt60, "drr_db": drr_db})


def click(rate: int, hz: float) -> np.ndarray:
    """6 ms of a burst at `hz` decaying from near full scale: a microphone's bump, a key."""
    t = np.arange(round(0.006 * rate)) / rate
    return 0.9 * np.sin(2 * np.pi * hz * t) * np.exp(-t / 0.0015)


def cheap_microphone(clip: Clip, name: str, db: float, offset: float, seed: int) -> Clip:
    """The clip `db` down through a cheap microphone: a DC offset of `offset` (of full scale)
    throughout, and a click near full scale (6 ms of a decaying burst: a bump, a key) in the
    lead and in one pause in four. Each is louder than the speech."""
    rng = random.Random(seed * 1_000_003 + zlib.crc32(name.encode()))
    audio = clip.audio * 10 ** (db / 20) + offset
    pauses = [g for g in clip.gaps[1:-1] if g["end"] - g["start"] > 0.2]
    clicked = [clip.gaps[0], *rng.sample(pauses, min(len(pauses), max(1, len(pauses) // 4)))]
    for g in clicked:
        burst = click(clip.rate, rng.uniform(800, 3000))
        at = round((g["start"] + g["end"]) / 2 * clip.rate)
        audio[at : at + burst.size] += rng.choice([-1, 1]) * burst
    offset_dbfs = round(20 * np.log10(offset), 3)
    gaps = [{**g, "kind": "offset", "noise_dbfs": offset_dbfs} for g in clip.gaps]
    info = {**clip.info, "speech_dbfs": clip.info["speech_dbfs"] + db, "gain_db": clip.info["gain_db"] + db,
            "noise": {"kind": "offset", "dbfs": offset_dbfs, "clicks": len(clicked)}}
    return Clip(name, name, audio.astype(np.float32), clip.rate, clip.sentences, gaps, info)


def hot_microphone(clip: Clip, name: str, db: float) -> Clip:
    """The clip `db` up through a microphone set too hot: clipped at full scale (a tenth of
    the samples at +20 dB)."""
    loud = with_gain(clip, name, db)
    clipped = np.clip(loud.audio, -1.0, 1.0)
    info = {**loud.info, "clipped": round(float(np.mean(np.abs(clipped) >= 1.0)), 4)}
    return Clip(name, name, clipped, loud.rate, loud.sentences, loud.gaps, info)


SOUNDS = ("music", "hum", "typing", "ringing", "breathing", "door", "rumble")
SOUND_EDGE_S = 0.5  # a sound in a gap stops this far from the speech on each side


def sound(kind: str, n: int, rate: int, rng: np.random.Generator) -> np.ndarray:
    """(n,) a sound that is not speech, at unit RMS: notes of a tune, mains hum, keys typed,
    a telephone ringing (2 s of 440 + 480 Hz in 6 s), breaths, doors slammed, low rumble."""
    t = np.arange(n) / rate
    if kind == "music":
        note = np.arange(round(0.3 * rate)) / rate
        freqs = 220 * 2 ** (rng.integers(0, 24, -(-n // note.size)) / 12)
        x = np.concatenate([sum(np.sin(2 * np.pi * f * k * note) / k for k in (1, 2, 3)) * np.exp(-3 * note)
                            for f in freqs])[:n]
    elif kind == "hum":
        x = sum(np.sin(2 * np.pi * 50 * k * t) / k for k in range(1, 6))
    elif kind in ("typing", "door"):
        length, count = (200, 7 * n // rate) if kind == "typing" else (rate // 2, 3)
        x = np.zeros(n)
        for at in rng.integers(0, max(1, n - length), max(1, count)):
            x[at : at + length] += np.exp(-np.arange(length) / (length / 7)) * rng.standard_normal(length)
    elif kind == "ringing":
        x = (np.sin(2 * np.pi * 440 * t) + np.sin(2 * np.pi * 480 * t)) * ((t % 6) < 2)
    elif kind == "breathing":
        breaths = np.clip(np.sin(2 * np.pi * t / 4), 0, None) ** 2  # one every 4 s
        x = np.convolve(rng.standard_normal(n), np.ones(8) / 8, "same") * breaths
    else:  # rumble: brown noise, its slow drift taken out
        x = np.cumsum(rng.standard_normal(n))
        x -= np.convolve(x, np.ones(4001) / 4001, "same")
    return x / max(np.sqrt(np.mean(x**2)), 1e-12)


def with_sounds(clip: Clip, name: str, seed: int, min_gap: float = 5.0) -> Clip:
    """Each gap of `min_gap` s or more holds a sound that is not speech (`SOUNDS`, a seeded
    order), at a seeded level from 10 dB under the speech to 8 dB over it (its peak at most
    PEAK_LIMIT), SOUND_EDGE_S from the speech on each side; the other pauses stay silent."""
    rng = np.random.default_rng(seed + zlib.crc32(name.encode()))
    audio, gaps = clip.audio.copy(), []
    kinds = list(rng.permutation(SOUNDS))
    for g in clip.gaps:
        if g["end"] - g["start"] < min_gap:
            gaps.append(g)
            continue
        kind = str(kinds.pop(0) if kinds else rng.choice(SOUNDS))
        a, b = round((g["start"] + SOUND_EDGE_S) * clip.rate), round((g["end"] - SOUND_EDGE_S) * clip.rate)
        x = sound(kind, b - a, clip.rate, rng)
        dbfs = clip.info["speech_dbfs"] + rng.uniform(-10, 8)
        gain = min(10 ** (dbfs / 20), PEAK_LIMIT / np.abs(x).max())
        audio[a:b] += gain * x
        dbfs = 20 * np.log10(gain)  # its peak kept under PEAK_LIMIT (a door's is 20 dB over its RMS)
        gaps.append({**g, "kind": "sound", "sound": kind, "noise_dbfs": round(dbfs, 3)})
    return Clip(name, name, audio.astype(np.float32), clip.rate, clip.sentences, gaps,
                {**clip.info, "noise": {"kind": "sounds in the long gaps"}})


def band_pass(x: np.ndarray, rate: int, low: float, high: float, order: int = 4) -> np.ndarray:
    """Zero-phase band-pass with the magnitude of an order-`order` Butterworth pair (by FFT)."""
    spectrum = np.fft.rfft(x)
    f = np.fft.rfftfreq(x.size, 1 / rate)
    f[0] = 1e-3
    gain = 1 / np.sqrt(1 + (low / f) ** (2 * order)) / np.sqrt(1 + (f / high) ** (2 * order))
    return np.fft.irfft(spectrum * gain, x.size).astype(np.float32)


def telephone(clip: Clip, name: str) -> Clip:
    audio = to_rate(band_pass(clip.audio, clip.rate, 300, 3400), clip.rate, 8000)
    return Clip(name, name, audio, 8000, clip.sentences, clip.gaps,
                {**clip.info, "band_hz": [300, 3400]})


def stereo_44k(clip: Clip, name: str, right_db: float = -2.0) -> Clip:
    left = to_rate(clip.audio, clip.rate, 44100)
    audio = np.stack([left, left * 10 ** (right_db / 20)], axis=1).astype(np.float32)
    return Clip(name, name, audio, 44100, clip.sentences, clip.gaps, {**clip.info, "right_db": right_db})


# ---------------------------------------------------------------------------------------------
# The conditions


def voices_rng(seed: int, name: str) -> random.Random:
    return random.Random(seed * 1_000_003 + zlib.crc32(name.encode()))


def recordings() -> dict[str, Piece]:
    """The real recordings of pocketsphinx-testdata, as pieces, by short name."""
    from tests.helpers import CARDS, librivox_path, transcripts

    texts = transcripts()
    out = {f"austen-{c}": recording_piece(librivox_path(c), texts[librivox_path(c)]) for c in AUSTEN}
    for path in sorted(CARDS.glob("*.wav")):
        out[f"cards-{path.stem}"] = recording_piece(path, texts[path])
    out["goforward"] = recording_piece(TESTDATA / "goforward.raw", "go forward ten meters")
    return out


def ivr_prompts() -> list[tuple[Path, str]]:
    """Asterisk's English prompts of five words or more, each text once, as (file, text):
    none that names a key by its sign (*, #), carries a note or trails off."""
    if not ASTERISK_TEXTS.is_file():
        raise SystemExit(f"{ASTERISK_TEXTS} is missing: apt-get install asterisk-core-sounds-en "
                         "asterisk-core-sounds-en-wav (scripts/dev.sh run installs them)")
    with gzip.open(ASTERISK_TEXTS, "rt") as f:
        lines = f.read().splitlines()
    prompts, seen = [], set()
    for line in lines:
        name, sep, text = line.partition(":")
        text = " ".join(text.split())
        path = ASTERISK / f"{name.strip()}.wav"
        if (not sep or line.startswith(";") or len(text.split()) < 5 or text.lower() in seen
                or re.search(r"[*#@()\[\]{}]|\bnote\b|\.\.\.", text, re.I) or not path.is_file()):
            continue
        seen.add(text.lower())
        prompts.append((path, text))
    return prompts


def sentences_of(first: int, last: int) -> list[str]:
    return [s for passage in PASSAGES[first:last] for s in passage]


def program(seed: int, quick: bool, real: dict[str, Piece]) -> Clip:
    """The speech under the level, noise, telephone and stereo conditions: a voice per sentence,
    real recordings among them, 0.6-1.2 s pauses."""
    rng = voices_rng(seed, "program")
    pieces = [tts_piece(t, random_voice(rng)) for t in sentences_of(0, 6)[: 3 if quick else None]]
    inserts = ["cards-002"] if quick else ["austen-0870", "cards-002", "austen-0920", "cards-005"]
    at = [round((i + 1) * len(pieces) / (len(inserts) + 1)) for i in range(len(inserts))]
    for i, key in reversed(list(zip(at, inserts, strict=True))):
        pieces.insert(i, real[key])
    return layout("program", "program", pieces, [rng.uniform(0.6, 1.2) for _ in pieces[1:]])


def festival(seed: int, quick: bool) -> list[Clip]:
    """The program's TTS sentences read by festival's voices, a voice per sentence, 0.6-1.2 s
    pauses: clean, and with pink noise 10 dB under the speech."""
    rng = voices_rng(seed, "festival")
    texts = sentences_of(0, 6)[: 3 if quick else None]
    pieces = [tts_piece(t, Voice("festival", rng.choice(FESTIVAL_VOICES), 100)) for t in texts]
    clip = layout("festival", "festival", pieces, [rng.uniform(0.6, 1.2) for _ in pieces[1:]])
    noisy = with_noise(clip, "festival-pink-snr10", "pink", clip.info["speech_dbfs"] - 10, seed)
    return [clip, noisy]


def program_conditions(clip: Clip, seed: int) -> list[Clip]:
    speech = clip.info["speech_dbfs"]
    out = [with_gain(clip, f"level-{-db}" if db else "level-0", db) for db in (0, -20, -30, -50)]
    out.append(with_drop(clip, "level-drop", -40))
    out += [with_noise(clip, f"{kind}-snr{snr}", kind, speech - snr, seed)
            for kind in ("pink", "white") for snr in (20, 10)]
    out += [with_babble(clip, "babble-snr12", 12.0, seed), reverberant(clip, "reverb", 0.5, seed)]
    out += [cheap_microphone(clip, "cheap-mic", -40.0, 0.01, seed), hot_microphone(clip, "hot-mic", 20.0)]
    return out + [telephone(clip, "telephone-8k"), stereo_44k(clip, "stereo-44k")]


def gap_clip(name: str, seed: int, quick: bool, first: int, long_gaps: list[float]) -> Clip:
    """Sentences with long gaps (5-60 s) at every other pause, in a seeded order."""
    rng = voices_rng(seed, name)
    texts = sentences_of(first, first + 3)[: 3 if quick else None]
    pieces = [tts_piece(t, random_voice(rng)) for t in texts]
    pauses = [rng.uniform(0.6, 1.2) for _ in pieces[1:]]
    long_gaps = rng.sample(long_gaps, len(long_gaps))
    where = np.linspace(0, len(pauses) - 1, len(long_gaps)).round().astype(int)
    for i, seconds in zip(where, long_gaps, strict=True):
        pauses[i] = seconds
    return layout(name, name, pieces, pauses)


def voiced_passages(passages: list[tuple[str, ...]], rng: random.Random) -> list[list[Piece]]:
    """Each passage's sentences, read by a voice of its own."""
    groups = []
    for passage in passages:
        voice = random_voice(rng)
        groups.append([tts_piece(t, voice) for t in passage])
    return groups


def close_pauses(seed: int, quick: bool) -> list[Clip]:
    """Passages, one voice each, whose sentences follow each other after 0.12-0.35 s
    (pauses-short) or 0.03-0.08 s (run-on): pauses too short for a VAD to end speech at."""
    out = []
    for name, first, low, high in (("pauses-short", 15, 0.12, 0.35), ("run-on", 21, 0.03, 0.08)):
        rng = voices_rng(seed, name)
        passages = [PASSAGES[first][:3]] if quick else list(PASSAGES[first : first + 6])
        pieces = [p for group in voiced_passages(passages, rng) for p in group]
        out.append(layout(name, name, pieces, [rng.uniform(low, high) for _ in pieces[1:]]))
    return out


def hesitant_piece(text: str, voice: Voice, rng: random.Random, low: float, high: float) -> Piece:
    """A sentence that stops once or twice for `low`-`high` s at seeded word boundaries."""
    words = text.split()
    cuts = sorted(rng.sample(range(1, len(words)), min(len(words) - 1, rng.choice([1, 2]))))
    parts = [" ".join(words[a:b]) for a, b in zip([0, *cuts], [*cuts, len(words)], strict=True)]
    breaks = [f' <break time="{round(rng.uniform(low, high) * 1000)}ms"/> ' for _ in cuts]
    ssml = "<speak>" + "".join(p + b for p, b in zip(parts, [*breaks, ""], strict=True)) + "</speak>"
    return make_piece(synthesize(ssml, voice, ssml=True), text, f"{voice.label} hesitant")


def hesitant(seed: int, quick: bool, low: float = 0.3, high: float = 1.5) -> Clip:
    """Passages, one espeak-ng voice each, their sentences stopping inside (`hesitant_piece`):
    pauses a VAD ends speech at, that end no sentence."""
    rng = voices_rng(seed, "hesitant")
    passages = [PASSAGES[3][:3]] if quick else list(PASSAGES[3:9])
    pieces = []
    for passage in passages:
        voice = espeak_voice(rng)
        pieces += [hesitant_piece(t, voice, rng, low, high) for t in passage]
    return layout("hesitant", "hesitant", pieces, [rng.uniform(0.6, 1.2) for _ in pieces[1:]])


def long_session(seed: int, quick: bool, real: dict[str, Piece]) -> Clip:
    """Passage after passage, one voice each, the Austen passages among them; 1.5 s pauses."""
    rng = voices_rng(seed, "long-session")
    passages = [PASSAGES[12][:4], PASSAGES[13][:2]] if quick else list(PASSAGES[6:30])
    groups = voiced_passages(passages, rng)
    austen = ["austen-0880"] if quick else [f"austen-{c}" for c in AUSTEN]
    groups.insert(len(groups) // 2, [real[k] for k in austen])
    if not quick:
        groups.insert(len(groups) // 4, [real["goforward"], real["cards-001"]])
    pieces = [p for group in groups for p in group]
    return layout("long-session", "long-session", pieces, [1.5] * (len(pieces) - 1))


def end_clips(seed: int, quick: bool) -> list[Clip]:
    """Short clips whose file ends 0-50 ms after the last word."""
    out = []
    for k in range(2 if quick else 8):
        name = f"end-abrupt-{k + 1}"
        rng = voices_rng(seed, name)
        passage = PASSAGES[(7 * k + 3) % len(PASSAGES)]
        voice = random_voice(rng)
        pieces = [tts_piece(t, voice) for t in passage[k % 3 : k % 3 + (2 if quick else 3)]]
        out.append(layout(name, "end-abrupt", pieces, [rng.uniform(0.6, 1.0) for _ in pieces[1:]],
                          tail=rng.uniform(0.0, 0.05)))
    return out


def previous_set(quick: bool, real: dict[str, Piece]) -> list[Clip]:
    """The earlier evaluation set: Austen passages once and in two repeated orders (0.8 s
    pauses), the card phrases (1.0 s), three espeak-ng passages (en-us, 150 words a minute)."""
    austen = [real[f"austen-{c}"] for c in AUSTEN]
    orders = {"austen-once": [0, 1, 2, 3, 4]}
    if not quick:
        orders["austen-1"] = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 2, 0, 4, 1, 3]
        orders["austen-2"] = [3, 1, 4, 0, 2, 1, 3, 0, 4, 2]
    out = [layout(name, "previous-set", [austen[j] for j in order], [0.8] * (len(order) - 1))
           for name, order in orders.items()]
    cards = [real[k] for k in sorted(real) if k.startswith("cards-")]
    out.append(layout("cards", "previous-set", cards, [1.0] * (len(cards) - 1)))
    for name, text in ({} if quick else PREVIOUS_PASSAGES).items():
        out.append(layout(name, "previous-set", [tts_piece(text, Voice("espeak", "en-us", 150))], []))
    return out


def real_ivr(seed: int, quick: bool) -> Clip:
    """Prompts of one voice talent, recorded at 8 kHz, in a seeded order."""
    rng = voices_rng(seed, "real-ivr")
    chosen = rng.sample(ivr_prompts(), 4 if quick else 64)
    pieces = [recording_piece(path, text) for path, text in chosen]
    return layout("real-ivr", "real-ivr", pieces, [rng.uniform(0.6, 1.2) for _ in pieces[1:]])


PROGRAM_CONDITIONS = ("level-0", "level-20", "level-30", "level-50", "level-drop", "pink-snr20",
                      "pink-snr10", "white-snr20", "white-snr10", "babble-snr12", "reverb", "cheap-mic",
                      "hot-mic", "telephone-8k", "stereo-44k")
CONDITIONS = (*PROGRAM_CONDITIONS, "festival", "festival-pink-snr10", "gaps-silence", "gaps-noise",
              "gaps-sounds", "pauses-short", "run-on", "hesitant", "long-session", "end-abrupt",
              "previous-set", "real-ivr")


def clips(seed: int = 0, quick: bool = False, conditions: Collection[str] = CONDITIONS) -> list[Clip]:
    """Every clip of the corpus's `conditions` (`quick`: a few minutes in all, every condition
    present). Each builder seeds its own generator, so a clip is the same built alone or with
    the rest."""
    want = set(conditions)
    real = recordings()
    out = program_conditions(program(seed, quick, real), seed) if want & set(PROGRAM_CONDITIONS) else []
    if want & {"festival", "festival-pink-snr10"}:
        out += festival(seed, quick)
    if "gaps-silence" in want:
        out.append(gap_clip("gaps-silence", seed, quick, 6, [5.0, 8.0] if quick else
                            [5.0, 8.0, 12.0, 20.0, 30.0, 45.0, 60.0]))
    if "gaps-noise" in want:
        noisy = gap_clip("gaps-noise", seed, quick, 9, [6.0, 5.0] if quick else
                         [6.0, 9.0, 10.0, 15.0, 25.0, 40.0, 55.0])
        out.append(with_noise(noisy, "gaps-noise", "pink", -60.0, seed))
    if "gaps-sounds" in want:
        sounds = gap_clip("gaps-sounds", seed, quick, 12, [5.0, 7.0] if quick else
                          [5.0, 7.0, 10.0, 14.0, 20.0, 30.0, 45.0])
        out.append(with_sounds(sounds, "gaps-sounds", seed))
    out += close_pauses(seed, quick) if want & {"pauses-short", "run-on"} else []
    out += [hesitant(seed, quick)] if "hesitant" in want else []
    out += [long_session(seed, quick, real)] if "long-session" in want else []
    out += end_clips(seed, quick) if "end-abrupt" in want else []
    out += previous_set(quick, real) if "previous-set" in want else []
    out += [real_ivr(seed, quick)] if "real-ivr" in want else []
    return [c for c in out if c.condition in want]


def manifest(clip: Clip, file: str) -> dict:
    return {"name": clip.name, "condition": clip.condition, "file": file, "sample_rate": clip.rate,
            "channels": 1 if clip.audio.ndim == 1 else clip.audio.shape[1],
            "duration": round(clip.audio.shape[0] / clip.rate, 4), **clip.info,
            "sentences": [{**s, "onset": round(s["onset"], 4), "end": round(s["end"], 4)}
                          for s in clip.sentences],
            "gaps": [{**g, "start": round(g["start"], 4), "end": round(g["end"], 4)} for g in clip.gaps]}


def build(folder: Path = DEFAULT_DIR, seeds: Sequence[int] = (0,), quick: bool = False,
          conditions: Collection[str] = CONDITIONS) -> Path:
    """Write every clip (`<name>.wav`, PCM16, and `<name>.json`) and `index.json` -> its path.
    Over several seeds each clip's name ends in `-s<seed>`; its condition stays, so a row pools
    the seeds."""
    unknown = sorted(set(conditions) - set(CONDITIONS))
    if unknown or not seeds:
        raise ValueError(f"unknown conditions {unknown}" if unknown else "no seed")
    folder.mkdir(parents=True, exist_ok=True)
    index = {"version": VERSION, "seeds": list(seeds), "quick": quick,
             "conditions": [c for c in CONDITIONS if c in set(conditions)], "clips": []}
    for seed in seeds:
        for clip in clips(seed, quick, conditions):
            name = clip.name if len(seeds) == 1 else f"{clip.name}-s{seed}"
            sf.write(str(folder / f"{name}.wav"), clip.audio, clip.rate, subtype="PCM_16")
            (folder / f"{name}.json").write_text(
                json.dumps({**manifest(clip, f"{name}.wav"), "name": name}, indent=1))
            speech = sum(s["end"] - s["onset"] for s in clip.sentences)
            index["clips"].append({"name": name, "condition": clip.condition, "seed": seed,
                                   "manifest": f"{name}.json", "duration": clip.audio.shape[0] / clip.rate,
                                   "speech": round(speech, 3)})
    path = folder / "index.json"
    path.write_text(json.dumps(index, indent=1))
    return path


def describe(seeds: Sequence[int], quick: bool) -> str:
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}{' (quick)' if quick else ''}"


def load_index(folder: Path, seeds: Sequence[int] = (0,), quick: bool = False, rebuild: bool = False,
               conditions: Collection[str] | None = None) -> dict:
    """The corpus in `folder`, built first when it is missing or older (of `conditions` only;
    None: every one, or those the folder holds). A corpus of other seeds or size, or one that
    lacks some of `conditions`, is another one's data: ValueError, unless `rebuild`."""
    path = folder / "index.json"
    index = json.loads(path.read_text()) if path.is_file() else None
    if not rebuild and index is not None and index["version"] == VERSION:
        held = index.get("seeds") or [index["seed"]]  # an index written before seeds were a list
        missing = sorted(set(conditions or []) - set(index.get("conditions", CONDITIONS)))
        if (list(held), index["quick"]) != (list(seeds), quick) or missing:
            raise ValueError(f"{folder} holds the corpus of {describe(held, index['quick'])}"
                             f"{f', without {missing}' if missing else ''}: pass its seeds and "
                             f"conditions, another folder, or --rebuild to replace it")
    if rebuild or index is None or index["version"] != VERSION:
        print(f"building the corpus in {folder} ...", file=sys.stderr)
        index = json.loads(build(folder, seeds, quick, conditions or CONDITIONS).read_text())
    return index


def summary(index: dict) -> str:
    by: dict[str, list[float]] = {}
    for c in index["clips"]:
        row = by.setdefault(c["condition"], [0, 0.0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + c["duration"], row[2] + c["speech"]
    lines = [f"{'condition':<20} {'clips':>5} {'audio min':>9} {'speech min':>10}"]
    lines += [f"{k:<20} {n:5d} {a / 60:9.2f} {s / 60:10.2f}" for k, (n, a, s) in by.items()]
    total = [sum(v[i] for v in by.values()) for i in range(3)]
    lines.append(f"{'all':<20} {total[0]:5d} {total[1] / 60:9.2f} {total[2] / 60:10.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Scoring a transcript with word times against a manifest

START_WORDS = 2  # a sentence's first words, scored apart (Score.start_errors)
MIN_GAP_S = 5.0  # gaps this long or longer are checked for words
GAP_EDGE_S = 0.2  # a word in a gap must lie inside it with this much cut off each edge


@dataclass
class TimedWord:
    word: str  # normalized (scripts/wer.py)
    start: float  # seconds
    end: float
    sentence: int = -1  # a reference word's sentence


@dataclass
class Score:
    errors: int  # word edit distance
    words: int  # reference words
    drop_s: float  # the longest dropped passage (words deleted): speech seconds of its words
    drop_words: int
    unmatched_s: float  # the longest run of words not found (deleted or misheard), seconds
    gap_words: int  # hypothesis words inside gaps of MIN_GAP_S or more ...
    gap_inserted: int  # ... of which matched no reference word (the others are mistimed)
    onset_errors: list[float]  # seconds, one per sentence whose first word was found
    sentence_errors: list[int]  # the errors charged to each sentence's words (`alignment`)
    sentence_words: list[int]  # each sentence's reference words
    # the errors charged to the first START_WORDS words of the sentences, and those words: the
    # first words after a pause are where streaming and offline part most
    start_errors: int = 0
    start_words: int = 0


def reference_words(sentences: list[dict]) -> list[TimedWord]:
    """Each sentence's normalized words, its onset..end spread over them by character count."""
    out = []
    for i, s in enumerate(sentences):
        words = normalize(s["text"])
        total, t = sum(len(w) for w in words), s["onset"]
        for w in words:
            span = (s["end"] - s["onset"]) * len(w) / total
            out.append(TimedWord(w, t, t + span, i))
            t += span
    return out


def hypothesis_words(words: list[tuple[float, float, str]]) -> list[TimedWord]:
    """(start, end, text) -> normalized words with those times ("10" gives one, "ten")."""
    return [TimedWord(w, start, end) for start, end, text in words for w in normalize(text)]


def align(ref: list[str], hyp: list[str]) -> tuple[int, list[int | None]]:
    """Levenshtein alignment -> (edit distance, for each reference word the index of the
    hypothesis word it equals, or None where it was deleted or substituted)."""
    distance, matches, _, _ = alignment(ref, hyp)
    return distance, matches


def alignment(ref: list[str], hyp: list[str]) -> tuple[int, list[int | None], list[bool], list[int]]:
    """`align`; for each reference word whether it was deleted (no hypothesis word stands for
    it: a substituted word was heard as another); and the errors charged to each reference
    word: its substitution or deletion, and the words inserted after it (before the first
    reference word: charged to it). With reference words, the charges sum to the edit distance."""
    n, m = len(ref), len(hyp)
    vocab = {w: i for i, w in enumerate(set(ref) | set(hyp))}
    h = np.array([vocab[w] for w in hyp], np.int64)
    cols = np.arange(m + 1)
    d = np.zeros((n + 1, m + 1), np.int32)
    d[0] = cols
    for i in range(1, n + 1):
        row = np.empty(m + 1, np.int64)
        row[0] = i
        row[1:] = np.minimum(d[i - 1, 1:] + 1, d[i - 1, :-1] + (h != vocab[ref[i - 1]]))
        d[i] = np.minimum.accumulate(row - cols) + cols  # insertions: row[j] <= row[j - 1] + 1
    matches: list[int | None] = [None] * n
    deleted = [True] * n  # those left at the start when the hypothesis runs out
    charged = [0] * n
    i, j = n, m
    while i > 0 and j > 0:
        same = ref[i - 1] == hyp[j - 1]
        if d[i, j] == d[i - 1, j - 1] + (not same):
            matches[i - 1] = j - 1 if same else None
            deleted[i - 1] = False
            charged[i - 1] += not same
            i, j = i - 1, j - 1
        elif d[i, j] == d[i - 1, j] + 1:
            charged[i - 1] += 1
            i -= 1
        else:
            charged[i - 1] += 1
            j -= 1
    for k in range(i):
        charged[k] += 1
    if n:
        charged[0] += j
    return int(d[n, m]), matches, deleted, charged


def longest_drop(ref: list[TimedWord], missing: list[bool]) -> tuple[float, int]:
    """The longest run of consecutive missing reference words -> (the speech seconds of its
    words, pauses between sentences left out; its words). Runs are ranked by seconds."""
    best, seconds, count = (0.0, 0), 0.0, 0
    for word, gone in zip(ref, missing, strict=True):
        if gone:
            seconds, count = seconds + word.end - word.start, count + 1
            best = max(best, (seconds, count))
        else:
            seconds, count = 0.0, 0
    return round(best[0], 3), best[1]


def words_in_gaps(hyp: list[TimedWord], gaps: list[dict], min_gap: float = MIN_GAP_S,
                  edge: float = GAP_EDGE_S) -> list[int]:
    """The hypothesis words (indices) whose start..end lies inside a gap of `min_gap` s or
    more, less `edge` s at each end of it."""
    long = [(g["start"] + edge, g["end"] - edge) for g in gaps if g["end"] - g["start"] >= min_gap]
    return [i for i, w in enumerate(hyp) if any(a <= w.start and w.end <= b for a, b in long)]


def onset_errors(ref: list[TimedWord], matches: list[int | None], hyp: list[TimedWord]) -> list[float]:
    """|hypothesis start - known onset| for each sentence whose first word was matched."""
    out, seen = [], set()
    for word, match in zip(ref, matches, strict=True):
        if word.sentence not in seen:
            seen.add(word.sentence)
            if match is not None:
                out.append(round(abs(hyp[match].start - word.start), 3))
    return out


def score(manifest: dict, words: list[tuple[float, float, str]]) -> Score:
    """A transcript's timed words (start s, end s, text) against the clip's manifest."""
    ref, hyp = reference_words(manifest["sentences"]), hypothesis_words(words)
    errors, matches, deleted, charged = alignment([w.word for w in ref], [w.word for w in hyp])
    drop_s, drop_words = longest_drop(ref, deleted)
    unmatched_s, _ = longest_drop(ref, [m is None for m in matches])
    in_gaps = words_in_gaps(hyp, manifest["gaps"])
    inserted = [i for i in in_gaps if i not in set(matches)]
    sentence_errors, sentence_words = [0] * len(manifest["sentences"]), [0] * len(manifest["sentences"])
    start_errors = start_words = 0
    for word, cost in zip(ref, charged, strict=True):
        if sentence_words[word.sentence] < START_WORDS:
            start_errors, start_words = start_errors + cost, start_words + 1
        sentence_errors[word.sentence] += cost
        sentence_words[word.sentence] += 1
    return Score(errors, len(ref), drop_s, drop_words, unmatched_s, len(in_gaps), len(inserted),
                 onset_errors(ref, matches, hyp), sentence_errors, sentence_words, start_errors,
                 start_words)


def paired_difference(a: list[Score], b: list[Score], draws: int = 2000,
                      seed: int = 0) -> tuple[float, float, float]:
    """WER of `a` minus WER of `b`, two systems' scores of the same clips, and its 95%
    interval by a paired bootstrap over the sentences: how far one decode of the same speech
    against another moves the difference, the rest of the clips being alike."""
    errors_a = np.array([e for x in a for e in x.sentence_errors], np.int64)
    errors_b = np.array([e for x in b for e in x.sentence_errors], np.int64)
    words = np.array([n for x in a for n in x.sentence_words], np.int64)
    if words.sum() == 0:
        return 0.0, 0.0, 0.0
    picks = np.random.default_rng(seed).integers(0, words.size, (draws, words.size))
    spread = (errors_a[picks].sum(1) - errors_b[picks].sum(1)) / np.maximum(words[picks].sum(1), 1)
    low, high = np.percentile(spread, [2.5, 97.5])
    return float((errors_a.sum() - errors_b.sum()) / words.sum()), float(low), float(high)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: data/corpus (data/corpus-quick)")
    parser.add_argument("--quick", action="store_true", help="a few minutes, every condition")
    parser.add_argument("--seeds", "--seed", type=int, nargs="+", default=[0],
                        help="several: each clip once per seed, named <clip>-s<seed>")
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS,
                        metavar="CONDITION", help="only these conditions")
    args = parser.parse_args()
    folder = args.out or DEFAULT_DIR.with_name("corpus-quick" if args.quick else "corpus")
    index = json.loads(build(folder, args.seeds, args.quick, args.conditions).read_text())
    print(f"{folder}:\n{summary(index)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
