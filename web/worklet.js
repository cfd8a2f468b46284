// AudioWorklet: microphone samples (the context's rate, e.g. 48 kHz) -> 16 kHz PCM16 frames.
//
// Resampling is band-limited (resampler.js: windowed sinc, no aliasing). Frames of `frameMs`
// go to the page as Int16Array buffers (transferred, not copied), each with the 16 kHz
// sample offset of its first sample.

import { OUT_RATE, Resampler, pcm16Sample } from "./resampler.js";

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const frameMs = options.processorOptions?.frameMs ?? 50;
    this.frameSize = (OUT_RATE * frameMs) / 1000;
    this.resampler = new Resampler(sampleRate);
    this.pending = new Int16Array(this.frameSize);
    this.filled = 0;
    this.offset = 0; // 16 kHz samples sent so far
    this.port.onmessage = (e) => {
      if (e.data === "flush" && this.filled) this.emit(this.filled);
    };
  }

  emit(n) {
    const frame = this.pending.slice(0, n);
    this.port.postMessage({ offset: this.offset, pcm: frame.buffer }, [frame.buffer]);
    this.offset += n;
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0]?.[0];
    if (channel) {
      for (const v of this.resampler.push(channel)) {
        this.pending[this.filled++] = pcm16Sample(v);
        if (this.filled === this.frameSize) this.emit(this.frameSize);
      }
    }
    return true;
  }
}

registerProcessor("voxtide-capture", CaptureProcessor);
