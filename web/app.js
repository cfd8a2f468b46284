// Voxtide page: microphone or file -> 16 kHz PCM16 frames over /v1/listen -> transcript.
//
// Committed text (final results, never revised) is shown with its start time; the tentative
// tail (the latest partial) is shown apart and replaced by each new partial. Each run (a
// microphone session or a file) is a transcript of its own, which can be copied or
// downloaded as text, SRT, WebVTT or JSON. A file the browser cannot decode is sent to the
// server's pre-recorded endpoint (POST /v1/listen), which reads any container ffmpeg reads. Frames go out
// only while the socket's bufferedAmount is under HIGH_WATER (backpressure: the rest waits
// here, nothing is dropped). A dropped connection is resumed with the session's resume
// token: the server says how much audio it has, and the frames after that are sent again.

import { OUT_RATE, Resampler, pcm16Sample } from "./resampler.js";

const FRAME_MS = 50;
const FRAME_SAMPLES = (OUT_RATE * FRAME_MS) / 1000;
const HIGH_WATER = 256 * 1024; // bytes waiting in the socket before frames are held back
const KEEP_SAMPLES = 120 * OUT_RATE; // audio kept for a resume after a dropped connection
const RETRY_MS = [250, 500, 1000, 2000, 4000, 8000];
// beyond Deepgram's defaults: partials, punctuation, and Voxtide's events (the resume token)
const CLIENT_QUERY = "interim_results=true&punctuate=true&voxtide_events=true";

const $ = (id) => document.getElementById(id);

function clock(ms) {
  const s = ms / 1000;
  return `${String(Math.floor(s / 60)).padStart(2, "0")}:${(s % 60).toFixed(1).padStart(4, "0")}`;
}

// One /v1/listen session of 16 kHz PCM16, across reconnects.
class ListenStream {
  constructor(view) {
    this.view = view;
    this.queue = []; // [offset, ArrayBuffer] not yet sent
    this.sent = []; // [offset, ArrayBuffer] sent, kept until acknowledged by a resume
    this.offset = 0; // 16 kHz samples handed to send()
    this.token = null;
    this.lastSeq = 0;
    this.closing = false; // CloseStream sent: a close now is the end
    this.retries = 0;
    this.done = new Promise((resolve) => (this.resolveDone = resolve));
    this.connect();
  }

  url() {
    const base = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/listen`;
    const key = $("key").value ? `&api_key=${encodeURIComponent($("key").value)}` : "";
    return this.token
      ? `${base}?resume_token=${encodeURIComponent(this.token)}&last_seq=${this.lastSeq}${key}`
      : `${base}?sample_rate=${OUT_RATE}&encoding=linear16&${CLIENT_QUERY}${key}`;
  }

  connect() {
    const ws = (this.ws = new WebSocket(this.url()));
    ws.binaryType = "arraybuffer";
    ws.onmessage = (e) => this.onMessage(JSON.parse(e.data));
    ws.onclose = (e) => this.onClose(e);
  }

  onMessage(m) {
    if (m.type === "Connected") {
      this.retries = 0;
      this.view.status(m.resumed ? "live (resumed)" : "live", "live");
      if (m.resumed) {
        // the server has audio_received_samples: send again whatever came after
        const have = m.audio_received_samples;
        const again = this.sent.filter(([offset, pcm]) => offset + pcm.byteLength / 2 > have);
        if (again.length && again[0][0] < have) {
          const [offset, pcm] = again[0];
          again[0] = [have, pcm.slice((have - offset) * 2)];
        }
        this.queue = again.concat(this.queue);
        this.sent = [];
      }
      this.token = m.resume_token;
      this.pump();
    } else if (m.type === "Results") {
      this.lastSeq = Math.max(this.lastSeq, m.seq);
      this.view.result(m);
    } else if (m.type === "Warning") {
      this.view.warning(m);
    } else if (m.type === "Error") {
      this.view.notice(`error: ${m.description}`);
    } else if (m.type === "Metadata") {
      this.view.done(`done: ${clock(m.duration * 1000)} transcribed`);
    }
  }

  onClose(e) {
    if (this.closing || e.code === 1000) {
      this.resolveDone();
      return;
    }
    // 1001: the server shut down and ended the session (its text so far is all here)
    if (this.token && e.code !== 1001 && this.retries < RETRY_MS.length) {
      const wait = RETRY_MS[this.retries++];
      this.view.status(`connection lost; reconnecting in ${wait} ms`, "error");
      setTimeout(() => this.connect(), wait);
      return;
    }
    this.view.status(`closed (${e.code}${e.reason ? ": " + e.reason : ""})`, "error");
    this.resolveDone();
  }

  send(pcm) {
    // pcm: Int16Array of 16 kHz samples
    this.queue.push([this.offset, pcm.buffer]);
    this.offset += pcm.length;
    this.pump();
  }

  pump() {
    const ws = this.ws;
    if (ws.readyState !== WebSocket.OPEN || !this.token) return;
    while (this.queue.length && ws.bufferedAmount < HIGH_WATER) {
      const frame = this.queue.shift();
      ws.send(frame[1]);
      this.sent.push(frame);
    }
    let kept = this.sent.reduce((n, [, pcm]) => n + pcm.byteLength / 2, 0);
    while (kept > KEEP_SAMPLES) kept -= this.sent.shift()[1].byteLength / 2;
    if (this.queue.length) {
      clearTimeout(this.timer);
      this.timer = setTimeout(() => this.pump(), 20);
    } else if (this.finishing) {
      this.closing = true;
      ws.send(JSON.stringify({ type: "CloseStream" }));
    }
  }

  finish() {
    this.finishing = true; // CloseStream once every queued frame is out
    this.pump();
    return this.done;
  }
}

function subtitleClock(seconds, decimal) {
  const ms = Math.max(0, Math.round(seconds * 1000));
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  const h = Math.floor(ms / 3600000), m = Math.floor(ms / 60000) % 60, s = Math.floor(ms / 1000) % 60;
  return `${pad(h)}:${pad(m)}:${pad(s)}${decimal}${pad(ms % 1000, 3)}`;
}

// The current run's transcript: its final segments, shown and exported.
const transcript = {
  title: "",
  segments: [], // {start, end, text, words: [{word, start, end, confidence}]}

  begin(title) {
    this.title = title;
    this.segments = [];
    $("committed").textContent = "";
    $("tentative").textContent = "";
    $("title").textContent = title;
    $("notice").hidden = true;
    this.buttons();
  },
  add(segment) {
    if (!segment.text) return;
    this.segments.push(segment);
    const span = document.createElement("span");
    span.className = "final";
    const time = document.createElement("time");
    time.textContent = clock(segment.start * 1000);
    span.append(time, `${segment.text} `);
    $("committed").append(span);
    this.buttons();
  },
  buttons() {
    const empty = this.segments.length === 0;
    $("copy").disabled = $("download").disabled = empty;
    $("clear").disabled = empty && !this.title;
  },
  text() {
    return this.segments.map((s) => s.text).join(" ");
  },
  export(format) {
    const cues = (decimal) => this.segments.map((s) =>
      `${subtitleClock(s.start, decimal)} --> ${subtitleClock(s.end, decimal)}\n${s.text}\n`);
    if (format === "srt") return cues(",").map((c, i) => `${i + 1}\n${c}`).join("\n");
    if (format === "vtt") return ["WEBVTT\n", ...cues(".")].join("\n");
    if (format === "json") {
      return JSON.stringify({ title: this.title, model: $("model").dataset.name || null,
                              segments: this.segments }, null, 2);
    }
    return this.text() + "\n";
  },
};

const view = {
  status(text, kind = "") {
    $("status").textContent = text;
    $("status").className = `status ${kind}`;
  },
  notice(text) {
    $("notice").textContent = text;
    $("notice").hidden = false;
  },
  warning(m) {
    if (m.code === "rate_limited") {
      const behind = Math.round((m.backlog_ms || 0) / 1000);
      this.notice(`The server is busy: the transcript is running about ${behind} s behind the audio.`);
    } else if (m.code === "server_shutting_down") {
      this.notice("The server is shutting down: the transcript of what it received is coming; start again to go on.");
    } else {
      this.notice(m.description);
    }
  },
  done(text) {
    this.status(text);
    $("notice").hidden = true; // a warning about the run is over with it
  },
  result(m) {
    const alternative = m.channel.alternatives[0];
    if (m.is_final) {
      if (alternative.transcript) {
        const words = alternative.words;
        transcript.add({ start: words[0].start, end: words[words.length - 1].end,
                         text: alternative.transcript, words });
      }
      if (!m.speech_final) return;
    }
    $("tentative").textContent = m.is_final ? "" : alternative.transcript;
  },
};

let capture = null; // {context, stream, node, listen}

async function startMicrophone() {
  $("start").disabled = true;
  try {
    const media = await navigator.mediaDevices.getUserMedia({
      // the raw signal transcribes best: no echo cancelling, noise suppression or gain riding
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
    const context = new AudioContext();
    await context.audioWorklet.addModule("/worklet.js");
    const node = new AudioWorkletNode(context, "voxtide-capture", { processorOptions: { frameMs: FRAME_MS } });
    transcript.begin(`microphone, ${new Date().toLocaleTimeString()}`);
    const listen = new ListenStream(view);
    node.port.onmessage = (e) => listen.send(new Int16Array(e.data.pcm));
    const mute = new GainNode(context, { gain: 0 }); // keeps the graph pulled, plays nothing
    context.createMediaStreamSource(media).connect(node).connect(mute).connect(context.destination);
    capture = { context, media, node, listen };
    $("stop").disabled = false;
    view.status(`capturing at ${context.sampleRate} Hz -> ${OUT_RATE} Hz`, "live");
  } catch (err) {
    view.status(`microphone unavailable: ${err.message}`, "error");
    $("start").disabled = false;
  }
}

async function stopMicrophone() {
  if (!capture) return;
  const { context, media, node, listen } = capture;
  capture = null;
  $("stop").disabled = true;
  media.getTracks().forEach((t) => t.stop());
  node.port.postMessage("flush");
  await new Promise((r) => setTimeout(r, 50)); // let the last frame arrive
  await context.close();
  view.status("finishing...");
  await listen.finish();
  $("tentative").textContent = "";
  $("start").disabled = false;
}

async function decodeInBrowser(file) {
  const context = new AudioContext();
  try {
    return await context.decodeAudioData(await file.arrayBuffer());
  } catch {
    return null; // not a format this browser decodes
  } finally {
    await context.close();
  }
}

async function transcribeFile(file) {
  $("file").disabled = true;
  transcript.begin(file.name);
  view.status(`decoding ${file.name}...`);
  try {
    const audio = await decodeInBrowser(file);
    if (audio) await streamFile(audio);
    else await uploadFile(file);
  } catch (err) {
    view.status(`cannot transcribe ${file.name}: ${err.message}`, "error");
  } finally {
    $("file").disabled = false;
    $("file").value = "";
  }
}

async function streamFile(audio) {
  const mono = new Float32Array(audio.length); // channels averaged
  for (let c = 0; c < audio.numberOfChannels; c++) {
    audio.getChannelData(c).forEach((v, i) => (mono[i] += v / audio.numberOfChannels));
  }
  const resampler = new Resampler(audio.sampleRate);
  const head = resampler.push(mono);
  const tail = resampler.flush();
  const samples = new Float32Array(head.length + tail.length);
  samples.set(head);
  samples.set(tail, head.length);
  const listen = new ListenStream(view);
  for (let i = 0; i < samples.length; i += FRAME_SAMPLES) {
    const piece = samples.subarray(i, i + FRAME_SAMPLES);
    listen.send(Int16Array.from(piece, pcm16Sample));
  }
  await listen.finish();
  $("tentative").textContent = "";
}

// The server decodes the file (POST /v1/listen, Deepgram's pre-recorded API) and answers
// with its utterances once all of it is transcribed.
async function uploadFile(file) {
  view.status(`transcribing ${file.name} on the server...`, "live");
  const headers = $("key").value ? { Authorization: `Token ${$("key").value}` } : {};
  const response = await fetch("/v1/listen?punctuate=true&utterances=true", { method: "POST", headers, body: file });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.err_msg || `HTTP ${response.status}`);
  for (const u of body.results.utterances || []) {
    transcript.add({ start: u.start, end: u.end, text: u.transcript, words: u.words });
  }
  view.done(`done: ${clock(body.metadata.duration * 1000)} transcribed`);
}

function download() {
  const format = $("format").value;
  const types = { txt: "text/plain", srt: "application/x-subrip", vtt: "text/vtt", json: "application/json" };
  const blob = new Blob([transcript.export(format)], { type: `${types[format]};charset=utf-8` });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `${(transcript.title || "transcript").replace(/[^\w.-]+/g, "_")}.${format}`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

async function showModel() {
  try {
    const health = await (await fetch("/healthz")).json();
    $("model").dataset.name = health.model;
    $("model").textContent = `model: ${health.model} (${health.device})`;
  } catch {
    $("model").textContent = "";
  }
}

$("start").onclick = startMicrophone;
$("stop").onclick = stopMicrophone;
$("file").onchange = (e) => e.target.files[0] && transcribeFile(e.target.files[0]);
$("copy").onclick = async () => {
  await navigator.clipboard.writeText(transcript.text());
  view.status("copied");
};
$("download").onclick = download;
$("clear").onclick = () => {
  transcript.begin("");
  view.status("idle");
};
showModel();
