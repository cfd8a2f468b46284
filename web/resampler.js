// Band-limited resampling for the browser: any rate -> 16 kHz, in pieces, seamlessly.
//
// Each output sample is the input convolved with a windowed-sinc low-pass (cutoff 0.45 x the
// output rate, Blackman window, 16 zero crossings each side) evaluated at the output's exact
// fractional position, so nothing above 7.2 kHz folds back into speech (plain decimation
// would alias it). Used by worklet.js (microphone); tests run it in Chromium.

export const OUT_RATE = 16000;

// A float sample in [-1, 1] -> the nearest PCM16 step (the server reads a step as 1/32768).
// An Int16Array truncates what it is given: a dead band around 0 that quiet input falls in.
export const pcm16Sample = (v) => Math.max(-32768, Math.min(32767, Math.round(v * 32768)));

const ZEROS = 16; // zero crossings of the sinc kept on each side

export class Resampler {
  constructor(inRate, outRate = OUT_RATE) {
    this.step = inRate / outRate; // input samples per output sample
    const ratio = Math.min(1, outRate / inRate);
    this.cutoff = 0.9 * ratio * 0.5; // cycles per input sample: 0.45 x the output rate
    this.half = Math.ceil(ZEROS / (2 * this.cutoff)); // taps each side, in input samples
    this.buffer = new Float32Array(0); // input samples not yet fully used
    this.start = 0; // input index of buffer[0]
    this.next = 0; // input position (fractional) of the next output sample
    this.received = 0; // input samples pushed
    this.emitted = 0; // output samples returned
  }

  kernel(d) {
    // windowed sinc at distance d (input samples) from the output position
    if (Math.abs(d) >= this.half) return 0;
    const x = 2 * this.cutoff * d;
    const sinc = x === 0 ? 1 : Math.sin(Math.PI * x) / (Math.PI * x);
    const w = 0.42 + 0.5 * Math.cos((Math.PI * d) / this.half) + 0.08 * Math.cos((2 * Math.PI * d) / this.half);
    return 2 * this.cutoff * sinc * w;
  }

  // Float32Array at the input rate -> Float32Array at 16 kHz (holds back `half` samples)
  push(input) {
    this.received += input.length;
    return this.resample(input);
  }

  // the end of the input: the held-back samples (as if followed by silence)
  flush() {
    const due = Math.ceil(this.received / this.step) - this.emitted;
    return this.resample(new Float32Array(2 * this.half + 2)).subarray(0, Math.max(0, due));
  }

  resample(input) {
    const joined = new Float32Array(this.buffer.length + input.length);
    joined.set(this.buffer);
    joined.set(input, this.buffer.length);
    const end = this.start + joined.length; // one past the last input index
    const out = [];
    while (this.next + this.half < end) {
      const center = this.next;
      const lo = Math.max(this.start, Math.ceil(center - this.half));
      const hi = Math.floor(center + this.half);
      let acc = 0;
      for (let k = lo; k <= hi; k++) acc += joined[k - this.start] * this.kernel(center - k);
      out.push(acc);
      this.next += this.step;
    }
    const keep = Math.max(this.start, Math.floor(this.next - this.half));
    this.buffer = joined.slice(keep - this.start);
    this.start = keep;
    this.emitted += out.length;
    return Float32Array.from(out);
  }
}
