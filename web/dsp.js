// Parley web client: small streaming DSP helpers (main thread).

// Two cascaded RBJ low-pass biquads, used before downsampling.
class LowPass {
  constructor(sampleRate, cutoff) {
    const w0 = (2 * Math.PI * cutoff) / sampleRate;
    const q = Math.SQRT1_2;
    const alpha = Math.sin(w0) / (2 * q);
    const cos = Math.cos(w0);
    const a0 = 1 + alpha;
    this.b0 = (1 - cos) / 2 / a0;
    this.b1 = (1 - cos) / a0;
    this.b2 = this.b0;
    this.a1 = (-2 * cos) / a0;
    this.a2 = (1 - alpha) / a0;
    this.s = [0, 0, 0, 0, 0, 0, 0, 0]; // x1 x2 y1 y2 for each of two stages
  }

  process(x) {
    const out = new Float32Array(x.length);
    const { b0, b1, b2, a1, a2, s } = this;
    for (let i = 0; i < x.length; i++) {
      let v = x[i];
      for (let k = 0; k < 8; k += 4) {
        const y = b0 * v + b1 * s[k] + b2 * s[k + 1] - a1 * s[k + 2] - a2 * s[k + 3];
        s[k + 1] = s[k]; s[k] = v; s[k + 3] = s[k + 2]; s[k + 2] = y;
        v = y;
      }
      out[i] = v;
    }
    return out;
  }
}

// Streaming linear-interpolation resampler with an anti-alias filter when downsampling.
// Good enough for speech; used only where the browser does not run at 24 kHz.
export class Resampler {
  constructor(fromRate, toRate) {
    this.from = fromRate;
    this.to = toRate;
    this.step = fromRate / toRate;
    this.pos = 1; // position in [prev, ...input]
    this.prev = 0;
    this.filter = fromRate > toRate ? new LowPass(fromRate, 0.45 * toRate) : null;
  }

  process(input) {
    if (this.from === this.to) return input;
    const x = this.filter ? this.filter.process(input) : input;
    const n = x.length;
    const out = new Float32Array(Math.ceil((n + 1) / this.step) + 1);
    let k = 0;
    let pos = this.pos;
    while (pos < n) {
      const i = Math.floor(pos);
      const frac = pos - i;
      const a = i === 0 ? this.prev : x[i - 1];
      const b = x[i];
      out[k++] = a + (b - a) * frac;
      pos += this.step;
    }
    this.pos = pos - n;
    if (n > 0) this.prev = x[n - 1];
    return out.subarray(0, k);
  }
}

// Root mean square and peak of a block.
export function levels(block) {
  let sum = 0;
  let peak = 0;
  for (let i = 0; i < block.length; i++) {
    const v = block[i];
    sum += v * v;
    const a = v < 0 ? -v : v;
    if (a > peak) peak = a;
  }
  return { rms: block.length ? Math.sqrt(sum / block.length) : 0, peak };
}

// Map an RMS amplitude to 0..1 for a meter (dBFS scale, -60 dB .. 0 dB).
export function meterValue(rms) {
  if (rms <= 0) return 0;
  const db = 20 * Math.log10(rms);
  return Math.max(0, Math.min(1, (db + 60) / 60));
}
