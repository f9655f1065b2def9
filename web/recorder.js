// Parley web client: the conversation as heard, both sides, for "Download recording".
//
// Left channel: the microphone as sent (silence while muted); right channel: the agent as
// played by the jitter buffer (silence where it ran dry, nothing of what it dropped). Both
// are placed by the audio clock (AudioContext.currentTime of their first sample), so they
// line up as the user heard them. Kept as 16-bit samples and capped (MAX_SECONDS) so a long
// call cannot grow memory without bound; the WAV is built only when downloaded.
// With `channels` 1 it records the microphone alone (the transcription section's recording).

export const MAX_SECONDS = 15 * 60;

export class Recording {
  constructor(sampleRate, maxSeconds = MAX_SECONDS, channels = 2) {
    this.sampleRate = sampleRate;
    this.channels = channels;
    this.maxSamples = Math.round(maxSeconds * sampleRate);
    this.t0 = null; // audio-clock time of sample 0
    this.chunks = Array.from({ length: channels }, () => []); // per channel: {at, pcm: Int16Array}
    this.length = 0; // samples, the longer channel
    this.truncated = false;
  }

  get seconds() { return this.length / this.sampleRate; }

  // channel 0 = microphone, 1 = agent; `time` = audio-clock time of pcm[0].
  add(channel, pcm, time) {
    if (this.t0 === null) this.t0 = time;
    const at = Math.max(0, Math.round((time - this.t0) * this.sampleRate));
    const n = Math.min(pcm.length, this.maxSamples - at);
    if (n < pcm.length) this.truncated = true;
    if (n <= 0) return;
    const s16 = new Int16Array(n);
    for (let i = 0; i < n; i++) s16[i] = Math.max(-32768, Math.min(32767, Math.round(pcm[i] * 32767)));
    this.chunks[channel].push({ at, pcm: s16 });
    this.length = Math.max(this.length, at + n);
  }

  // A 16-bit PCM WAV file (stereo by default).
  wav() {
    const frames = this.length;
    const nch = this.channels;
    const data = new Int16Array(frames * nch);
    for (let ch = 0; ch < nch; ch++) {
      for (const { at, pcm } of this.chunks[ch]) {
        for (let i = 0; i < pcm.length; i++) data[(at + i) * nch + ch] = pcm[i];
      }
    }
    const header = new DataView(new ArrayBuffer(44));
    const text = (off, s) => { for (let i = 0; i < s.length; i++) header.setUint8(off + i, s.charCodeAt(i)); };
    text(0, 'RIFF');
    header.setUint32(4, 36 + data.byteLength, true);
    text(8, 'WAVE');
    text(12, 'fmt ');
    header.setUint32(16, 16, true); // PCM fmt chunk size
    header.setUint16(20, 1, true); // PCM
    header.setUint16(22, nch, true); // channels
    header.setUint32(24, this.sampleRate, true);
    header.setUint32(28, this.sampleRate * 2 * nch, true); // byte rate
    header.setUint16(32, 2 * nch, true); // block align
    header.setUint16(34, 16, true); // bits per sample
    text(36, 'data');
    header.setUint32(40, data.byteLength, true);
    return new Blob([header.buffer, data.buffer], { type: 'audio/wav' });
  }
}
