"""The web page in headless Chromium (Debian's, driven by Playwright) against a real server.

The microphone is Chromium's fake capture device playing a recording; the page resamples it
to 16 kHz in its AudioWorklet and streams PCM16 frames. The screenshot of each run is kept
in $VOXTIDE_ARTIFACTS (default: test-artifacts/).
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from audio import load_audio
from tests.helpers import concatenated, encode, librivox_path, transcripts
from tests.server_client import ThreadedServer, drop_server_side
from tests.test_server import error_rate

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("VOXTIDE_ARTIFACTS", "test-artifacts"))
CHROMIUM_FLAGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--use-fake-ui-for-media-stream",
                  "--use-fake-device-for-media-stream", "--autoplay-policy=no-user-gesture-required"]

playwright = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():  # scripts/dev.sh installs it; this guards a bare pytest run
    pytest.skip("Chromium is not installed (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> tuple[Path, str]:
    """Three arctic sentences with pauses, as a 48 kHz 16-bit WAV (Chromium's capture rate)."""
    import torchaudio.functional as AF

    paths = [librivox_path(c) for c in ("0890", "0920", "0930")]
    samples, reference = concatenated(paths, gap_seconds=1.0)
    path = tmp_path_factory.mktemp("web") / "speech.wav"
    sf.write(path, AF.resample(samples, 16000, 48000).numpy(), 48000, subtype="PCM_16")
    assert reference == " ".join(transcripts()[p] for p in paths)
    return path, reference


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ThreadedServer(tmp_path_factory.mktemp("web-server")) as running:
        yield running


def browser(p, *flags: str):
    return p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[*CHROMIUM_FLAGS, *flags])


def committed_text(page) -> str:
    return page.eval_on_selector_all("#committed .final", "spans => spans.map(s => s.lastChild.textContent)"
                                     ".join(' ')")


def audio_received(server: ThreadedServer) -> float:
    return server.server.metrics.value("voxtide_audio_seconds_total")


def wait_for_audio(page, server: ThreadedServer, seconds: float, deadline: float) -> None:
    """Until the server has received `seconds` of audio (Chromium plays the file in real time)."""
    while audio_received(server) < seconds:
        assert time.monotonic() < deadline, f"only {audio_received(server):.1f} s arrived"
        page.wait_for_timeout(100)


def stop_and_read(page) -> tuple[str, str]:
    """Click Stop, wait for the session's end -> (committed text, status line)."""
    page.click("#stop")
    page.wait_for_function("document.querySelector('#status').textContent.startsWith('done')",
                           timeout=60_000)
    return committed_text(page), page.text_content("#status")


def run_on_page(server: ThreadedServer, script: str):
    """What `script` (a JavaScript function) returns, run in the page the server serves."""
    with playwright.sync_playwright() as p:
        chromium = browser(p)
        page = chromium.new_page()
        page.goto(f"http://127.0.0.1:{server.server.port}/")
        out = page.evaluate(script)
        chromium.close()
    return out


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def test_microphone_page_transcribes_the_fake_capture(server, recording):
    wav, reference = recording
    assert audio_received(server) == 0  # this test runs first on its server
    with playwright.sync_playwright() as p:
        chromium = browser(p, f"--use-file-for-fake-audio-capture={wav}%noloop")
        page = chromium.new_page()
        page.goto(f"http://127.0.0.1:{server.server.port}/")
        page.click("#start")
        seconds = sf.info(str(wav)).duration
        wait_for_audio(page, server, seconds - 0.2, time.monotonic() + seconds + 60)
        tentative_style = page.eval_on_selector("#tentative", "e => getComputedStyle(e).fontStyle")
        final_style = page.eval_on_selector("#committed .final", "e => getComputedStyle(e).fontStyle")
        times = page.eval_on_selector_all("#committed time", "ts => ts.map(t => t.textContent)")
        screenshot(page, "web-microphone.png")
        text, status = stop_and_read(page)
        chromium.close()
    assert error_rate(reference, text) <= 0.15, text
    assert tentative_style == "italic" and final_style == "normal"
    assert times and times == sorted(times) and all(len(t) == 7 for t in times)  # mm:ss.s, in order
    assert "capturing at" not in status  # the session ended with its Metadata


def drop_connection(server: ThreadedServer) -> None:
    """Cut the session's TCP connection on the server side, with no close frame."""
    (session,) = server.server.sessions.values()
    server.loop.call_soon_threadsafe(drop_server_side, server.server, session)  # on its own loop


def test_microphone_page_resumes_after_a_dropped_connection(tmp_path, recording):
    wav, reference = recording
    seconds = sf.info(str(wav)).duration
    with ThreadedServer(tmp_path) as server, playwright.sync_playwright() as p:
        chromium = browser(p, f"--use-file-for-fake-audio-capture={wav}%noloop")
        page = chromium.new_page()
        page.goto(f"http://127.0.0.1:{server.server.port}/")
        page.click("#start")
        deadline = time.monotonic() + seconds + 60
        wait_for_audio(page, server, 5.0, deadline)
        drop_connection(server)
        page.wait_for_function("document.querySelector('#status').textContent.includes('reconnecting')",
                               timeout=10_000)
        page.wait_for_function("document.querySelector('#status').textContent === 'live (resumed)'",
                               timeout=30_000)
        wait_for_audio(page, server, seconds - 0.2, deadline)
        screenshot(page, "web-resumed.png")
        text, status = stop_and_read(page)
        resumed = server.server.metrics.value("voxtide_sessions_resumed_total", protocol="listen")
        chromium.close()
    assert resumed == 1
    # the server counted each sample once (re-sent audio is trimmed to what it had) ...
    received = float(status.removeprefix("done: 00:").removesuffix(" transcribed"))
    assert abs(received - seconds) < 1.0, status
    # ... and the text has no gap and no repeat across the drop
    assert error_rate(reference, text) <= 0.15, text


def test_upload_mode_transcribes_a_file(server, recording):
    wav, reference = recording
    with playwright.sync_playwright() as p:
        chromium = browser(p)
        page = chromium.new_page()
        page.goto(f"http://127.0.0.1:{server.server.port}/")
        page.set_input_files("#file", str(wav))
        page.wait_for_function("document.querySelector('#status').textContent.startsWith('done')",
                               timeout=120_000)
        text = committed_text(page)
        status = page.text_content("#status")
        screenshot(page, "web-upload.png")
        chromium.close()
    seconds = sf.info(str(wav)).duration
    assert status == f"done: 00:{seconds:04.1f} transcribed", status  # all of the file arrived
    assert error_rate(reference, text) <= 0.15, text


def test_browser_resampler_is_band_limited_and_seamless(server):
    script = """async () => {
      const { Resampler } = await import('/resampler.js');
      const sine = (hz, n) => Float32Array.from({length: n},
                                                (_, i) => 0.5 * Math.sin(2 * Math.PI * hz * i / 48000));
      const rms = (x) => Math.sqrt(x.reduce((a, v) => a + v * v, 0) / x.length);
      const mid = (x) => x.subarray(1600, x.length - 1600);
      const whole = (x) => { const r = new Resampler(48000); return [...r.push(x), ...r.flush()]; };
      const pass = Float32Array.from(whole(sine(1000, 96000)));
      const alias = Float32Array.from(whole(sine(12000, 96000)));
      const mixed = sine(440, 48000).map((v, i) => v + 0.3 * Math.sin(i * 0.37) + 0.1 * Math.sin(i * 0.05));
      const once = whole(mixed);
      const r = new Resampler(48000);
      let parts = [], at = 0, size = 1;
      while (at < mixed.length) {
        parts.push(...r.push(mixed.subarray(at, at + size)));
        at += size;
        size = size * 3 % 997 + 1;
      }
      parts.push(...r.flush());
      let diff = 0;
      for (let i = 0; i < Math.min(once.length, parts.length); i++) {
        diff = Math.max(diff, Math.abs(once[i] - parts[i]));
      }
      return {pass: rms(mid(pass)), alias: rms(mid(alias)), input: rms(sine(1000, 96000)),
              n: pass.length, diff, lengths: [once.length, parts.length]};
    }"""
    r = run_on_page(server, script)
    assert r["n"] == 32000  # 2 s at 16 kHz, the held-back tail flushed
    assert abs(r["pass"] / r["input"] - 1) < 0.01  # 1 kHz passes at unity gain
    assert r["alias"] / r["input"] < 1e-3  # 12 kHz (above 8 kHz) is removed, not folded to 4 kHz
    assert r["lengths"][0] == r["lengths"][1] and r["diff"] < 1e-6  # pieces == whole signal
    assert np.isfinite(r["pass"])


def test_the_page_sends_each_sample_as_the_nearest_pcm16_step(server):
    # what the microphone and a file streamed from the page send: truncated, quiet input
    # (a few steps high) would lose a step off every sample
    steps = [0.4, -0.4, 0.6, -0.6, 7.0, -7.0, 32767.4, -32768.4]
    script = f"""async () => {{
      const {{ pcm16Sample }} = await import('/resampler.js');
      const out = Int16Array.from({[v / 32768 for v in steps]}, pcm16Sample);
      return [...out, pcm16Sample(1.5), pcm16Sample(-1.5)];
    }}"""
    out = run_on_page(server, script)
    assert out == [0, 0, 1, -1, 7, -7, 32767, -32768, 32767, -32768]


def test_files_the_browser_cannot_decode_go_to_the_server_each_run_its_own(server, recording, tmp_path):
    """A format Chromium does not decode (MPEG-1 Layer II) is transcribed by the server's
    pre-recorded endpoint; a non-audio file gets the server's reason; each file is a
    transcript of its own, downloadable as SRT and JSON; the page shows the model."""
    wav, reference = recording
    mp2 = tmp_path / "speech.mp2"
    mp2.write_bytes(encode(load_audio(wav), "mp2", "mp2"))
    junk = tmp_path / "notes.txt"
    junk.write_text("not audio\n" * 100)
    uploads = server.server.metrics.value("voxtide_uploads_total", endpoint="listen", outcome="ok")
    with playwright.sync_playwright() as p:
        chromium = browser(p)
        page = chromium.new_page()
        page.goto(f"http://127.0.0.1:{server.server.port}/")
        page.wait_for_function("document.querySelector('#model').textContent.includes('whisper')")
        for path in (mp2, mp2):  # twice: the second run replaces the first
            page.set_input_files("#file", str(path))
            page.wait_for_function("document.querySelector('#status').textContent.startsWith('done')",
                                   timeout=120_000)
        text, title = committed_text(page), page.text_content("#title")
        downloads = {}
        for fmt in ("srt", "json"):
            page.select_option("#format", fmt)
            with page.expect_download() as info:
                page.click("#download")
            downloads[fmt] = Path(info.value.path()).read_text()
        page.set_input_files("#file", str(junk))
        page.wait_for_function("document.querySelector('#status').textContent.startsWith('cannot')")
        status, after = page.text_content("#status"), committed_text(page)
        screenshot(page, "web-server-upload.png")
        chromium.close()
    metrics = server.server.metrics
    assert metrics.value("voxtide_uploads_total", endpoint="listen", outcome="ok") == uploads + 2
    assert error_rate(reference, text) <= 0.15, text
    assert title == "speech.mp2" and after == ""
    assert "cannot read this audio" in status, status
    segments = json.loads(downloads["json"])["segments"]
    assert " ".join(s["text"] for s in segments).split() == text.split()
    blocks = downloads["srt"].strip().split("\n\n")
    assert len(blocks) == len(segments) and blocks[0].split("\n")[0] == "1"
    assert re.fullmatch(r"\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}", blocks[0].split("\n")[1])
