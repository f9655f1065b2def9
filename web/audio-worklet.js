// Parley web client: AudioWorklet processors.
//
// parley-capture: collects microphone samples into ~20 ms blocks and posts them (with
//   the audio-clock time of their first sample) to the main thread, which encodes them.
// parley-player: the jitter buffer. The main thread posts decoded PCM at the context's
//   rate; the processor plays it out after a short hold-off, holds off a little longer
//   after an underrun, and drops audio when the buffer's floor stays high (lag must not grow).
//   It also posts what it played, ~100 ms at a time with its audio-clock time, for the
//   page's recording.

class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.blockSize = Math.round(sampleRate * 0.02);
    this.buf = new Float32Array(this.blockSize);
    this.fill = 0;
    this.start = 0; // audio-clock time of buf[0]
  }

  process(inputs) {
    const input = inputs[0];
    const ch = input && input[0];
    if (ch) {
      let i = 0;
      while (i < ch.length) {
        if (this.fill === 0) this.start = currentTime + i / sampleRate;
        const n = Math.min(ch.length - i, this.blockSize - this.fill);
        this.buf.set(ch.subarray(i, i + n), this.fill);
        this.fill += n;
        i += n;
        if (this.fill === this.blockSize) {
          const block = this.buf;
          this.port.postMessage({ pcm: block, time: currentTime, start: this.start }, [block.buffer]);
          this.buf = new Float32Array(this.blockSize);
          this.fill = 0;
        }
      }
    }
    return true;
  }
}

class PlayerProcessor extends AudioWorkletProcessor {
  // Audio arrives in bursts (the server sends one 80 ms model frame at a time), so the fill
  // level saw-tooths between a floor and floor + burst. The floor is the delay we add on top
  // of what the bursts need. On (re)start the player holds off for `margin` before playing,
  // which sets the floor; each underrun raises the margin a little (up to a cap), and when
  // the floor over a window is well above the margin (lag crept in: a network stall, a
  // clock drift), the excess is dropped at once rather than played late. After a calm
  // stretch with no underrun the margin comes back down.
  constructor(options) {
    super();
    const o = (options && options.processorOptions) || {};
    const ms = (x) => Math.round((x / 1000) * sampleRate);
    this.marginMin = ms(o.marginMs ?? 20);
    this.margin = this.marginMin;
    this.calm = 0; // samples played since the last underrun
    this.calmNeeded = ms(o.calmMs ?? 5000); // this long without an underrun -> lower the margin
    this.marginStep = ms(o.marginStepMs ?? 10);
    this.marginMax = ms(o.marginMaxMs ?? 60);
    this.slack = ms(o.slackMs ?? 30); // floor above margin + slack for a window -> drop
    this.hardLimit = ms(o.hardLimitMs ?? 200); // never hold more than this...
    this.hardKeep = ms(o.hardKeepMs ?? 80); // ...drop down to this when it happens
    this.window = ms(o.windowMs ?? 1000);
    this.queue = []; // {pcm, off}
    this.queued = 0;
    this.playing = false;
    this.started = false;
    this.holdoff = 0;
    this.windowMin = Infinity;
    this.windowPos = 0;
    this.avgFill = 0;
    this.played = 0; // samples played from the queue
    this.playedChunks = 0;
    this.dropped = 0; // samples dropped to keep latency down
    this.underruns = 0;
    this.statsCountdown = 0;
    this.recSize = Math.round(sampleRate * 0.1); // what was played, for the recording
    this.rec = new Float32Array(this.recSize);
    this.recFill = 0;
    this.recStart = 0;
    this.port.onmessage = (e) => {
      const d = e.data;
      if (d.pcm) {
        this.queue.push({ pcm: d.pcm, off: 0 });
        this.queued += d.pcm.length;
        if (this.queued > this.hardLimit) this.drop(this.queued - this.hardKeep);
        if (!this.playing && this.holdoff === 0) this.holdoff = this.margin;
      } else if (d.reset) {
        this.queue = [];
        this.queued = 0;
        this.playing = false;
        this.holdoff = 0;
      }
    };
  }

  drop(n) {
    n = Math.min(n, this.queued);
    this.dropped += n;
    this.queued -= n;
    while (n > 0 && this.queue.length) {
      const head = this.queue[0];
      const left = head.pcm.length - head.off;
      if (left <= n) { this.queue.shift(); n -= left; } else { head.off += n; n = 0; }
    }
  }

  // Posts what was played (silence where the buffer ran dry), ~100 ms at a time.
  record(out) {
    let i = 0;
    while (i < out.length) {
      if (this.recFill === 0) this.recStart = currentTime + i / sampleRate;
      const n = Math.min(out.length - i, this.rec.length - this.recFill);
      this.rec.set(out.subarray(i, i + n), this.recFill);
      this.recFill += n;
      i += n;
      if (this.recFill === this.rec.length) {
        const chunk = this.rec;
        this.port.postMessage({ played: chunk, time: this.recStart }, [chunk.buffer]);
        this.rec = new Float32Array(this.recSize); // (the posted chunk's buffer is transferred)
        this.recFill = 0;
      }
    }
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    const len = out.length;
    if (!this.playing && this.queued > 0) {
      this.holdoff -= len;
      if (this.holdoff <= 0) { this.holdoff = 0; this.playing = true; this.started = true; }
    }
    if (this.playing) {
      // Average fill: exponential moving average with a 1 s time constant (the fill
      // saw-tooths with each burst, so a snapshot says little).
      this.avgFill += (this.queued - this.avgFill) * Math.min(1, len / sampleRate);
      if (this.queued < this.windowMin) this.windowMin = this.queued;
      let i = 0;
      while (i < len && this.queue.length) {
        const head = this.queue[0];
        const n = Math.min(len - i, head.pcm.length - head.off);
        out.set(head.pcm.subarray(head.off, head.off + n), i);
        head.off += n;
        i += n;
        if (head.off >= head.pcm.length) { this.queue.shift(); this.playedChunks++; }
      }
      this.played += i;
      this.queued -= i;
      this.calm += i;
      if (this.calm >= this.calmNeeded) {
        this.calm = 0;
        this.margin = Math.max(this.marginMin, this.margin - this.marginStep);
      }
      if (i < len) { // ran dry: silence, a larger margin, and hold off again on the next data
        this.underruns++;
        this.calm = 0;
        this.playing = false;
        this.margin = Math.min(this.margin + this.marginStep, this.marginMax);
        this.holdoff = 0;
        this.windowMin = Infinity;
        this.windowPos = 0;
      } else {
        this.windowPos += len;
        if (this.windowPos >= this.window) {
          // The lowest fill over the window is delay that no burst needed: remove the excess.
          if (this.windowMin > this.margin + this.slack) this.drop(this.windowMin - this.margin);
          this.windowMin = Infinity;
          this.windowPos = 0;
        }
      }
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    this.record(out);
    this.statsCountdown -= len;
    if (this.statsCountdown <= 0) {
      this.statsCountdown = Math.round(sampleRate * 0.1);
      const avg = this.avgFill;
      this.port.postMessage({
        stats: {
          bufferedMs: (this.queued / sampleRate) * 1000,
          avgBufferedMs: (avg / sampleRate) * 1000,
          marginMs: (this.margin / sampleRate) * 1000,
          playedSamples: this.played,
          playedChunks: this.playedChunks,
          droppedMs: (this.dropped / sampleRate) * 1000,
          underruns: this.underruns,
          playing: this.playing,
        },
      });
    }
    return true;
  }
}

registerProcessor('parley-capture', CaptureProcessor);
registerProcessor('parley-player', PlayerProcessor);
