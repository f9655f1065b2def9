// Parley web client: the sections below the voice chat, one for each other thing the server serves.
//
// Each section calls its public door exactly as any client would (an OpenAI SDK, curl): the same
// path, a JSON or multipart body naming `model`, the key as `Authorization: Bearer`, and OpenAI's
// error shape read back and shown. A section shows only when GET /v1/models lists a model of its
// modality, and it names that modality's first model (the checkpoint's own name). Nothing here
// knows how the server works inside.
//
// Adding a section (translation, once its door exists): its markup in index.html, hidden, and an
// entry in SECTIONS naming the modality /v1/models lists for it and the function that wires it.

import { Recording } from './recorder.js';

const RECORD_MAX_SECONDS = 60; // a recording to transcribe stops by itself after this long
const IMAGE_PARTIALS = 2; // previews asked of a streamed image (the server may send fewer)

// Test and debugging hooks: what each section did last (read-only).
const doors = {
  ready: false, // /v1/models was read and the served sections shown
  modalities: [],
  speech: { state: 'idle', message: '', bytes: 0, ms: 0 },
  transcription: { state: 'idle', message: '', text: '', clipBytes: 0, recordingMs: 0, recordedMs: 0 },
  image: { state: 'idle', message: '', partials: 0, width: 0, height: 0, ms: 0 },
};
window.parleyDoors = doors;

const SECTIONS = [
  { modality: 'tts', id: 'speech-section', init: initSpeech },
  { modality: 'stt', id: 'transcribe-section', init: initTranscription },
  { modality: 'image', id: 'image-section', init: initImage },
  // { modality: 'translation', id: 'translate-section', init: initTranslation }: once it is served.
];

const $ = (id) => document.getElementById(id);

// `base`: the server's address (URL); `key`: its API key or null.
export async function initSections({ base, key }) {
  const api = { url: (path) => new URL(path, base), auth: key ? { Authorization: `Bearer ${key}` } : {} };
  let listing;
  try {
    const r = await fetch(api.url('/v1/models'), { headers: { ...api.auth, Accept: 'application/json' } });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    listing = await r.json();
  } catch (_) {
    doors.ready = true; // no listing: only the voice chat shows
    return;
  }
  const names = {};
  for (const m of listing.data || []) if (m.modality) (names[m.modality] ||= []).push(m.id);
  doors.modalities = Object.keys(names);
  for (const s of SECTIONS) {
    if (!names[s.modality]) continue;
    $(s.id).hidden = false;
    s.init({ ...api, model: names[s.modality][0] });
  }
  doors.ready = true;
}

// OpenAI's error body's message, or the HTTP status.
async function failure(reply) {
  const body = await reply.json().catch(() => null);
  return (body && body.error && body.error.message) || `HTTP ${reply.status}`;
}

function say(el, text, isError = false) {
  el.textContent = text;
  el.classList.toggle('error', isError);
}

function seconds(ms) { return `${(ms / 1000).toFixed(1)} s`; }

// One request at a time per section: the button is off while it runs; the outcome in `record`.
async function run(button, status, record, work) {
  button.disabled = true;
  Object.assign(record, { state: 'busy', message: '' });
  const t0 = performance.now();
  try {
    await work();
    record.ms = performance.now() - t0;
    record.state = 'done';
  } catch (e) {
    const message = e && e.message ? e.message : String(e);
    Object.assign(record, { state: 'error', message });
    say(status, message, true);
  } finally {
    button.disabled = false;
  }
}

// ---- speak a text: POST /v1/audio/speech ------------------------------------------------------

function initSpeech(api) {
  const ui = { input: $('speech-input'), voice: $('speech-voice'), go: $('speech-go'), status: $('speech-status'),
    audio: $('speech-audio') };
  loadSpeechVoices(api, ui.voice);
  ui.go.addEventListener('click', () => run(ui.go, ui.status, doors.speech, () => speak(api, ui)));
}

async function loadSpeechVoices(api, select) {
  try {
    const r = await fetch(api.url('/v1/audio/voices'), { headers: api.auth });
    if (!r.ok) throw new Error(await failure(r));
    for (const v of (await r.json()).data || []) select.append(new Option(v.name || v.id, v.id));
  } catch (e) {
    say($('speech-status'), `Could not list the voices: ${e.message || e}`, true);
  }
}

async function speak(api, ui) {
  const input = ui.input.value.trim();
  if (!input) throw new Error('Type a text to speak.');
  say(ui.status, 'Speaking…');
  const body = { model: api.model, input, voice: ui.voice.value, response_format: 'wav' };
  const t0 = performance.now();
  const r = await fetch(api.url('/v1/audio/speech'), {
    method: 'POST', headers: { ...api.auth, 'Content-Type': 'application/json' }, body: JSON.stringify(body),
  });
  if (!r.ok) throw new Error(await failure(r));
  const wav = await r.blob();
  doors.speech.bytes = wav.size;
  if (ui.audio.src) URL.revokeObjectURL(ui.audio.src);
  ui.audio.src = URL.createObjectURL(wav);
  ui.audio.hidden = false;
  const took = performance.now() - t0;
  ui.audio.addEventListener('loadedmetadata', () => {
    say(ui.status, `${seconds(ui.audio.duration * 1000)} of speech (${api.model}, voice ${body.voice}), `
      + `made in ${seconds(took)}.`);
  }, { once: true });
  ui.audio.play().catch(() => { /* the player's own button plays it */ });
}

// ---- transcribe a recording: POST /v1/audio/transcriptions ------------------------------------

function initTranscription(api) {
  const ui = { file: $('transcribe-file'), record: $('transcribe-record'), clip: $('transcribe-clip'),
    audio: $('transcribe-audio'), go: $('transcribe-go'), status: $('transcribe-status'), text: $('transcribe-text') };
  const state = { clip: null, recorder: null };
  const useClip = (blob, name, what) => {
    state.clip = { blob, name };
    doors.transcription.clipBytes = blob.size;
    if (ui.audio.src) URL.revokeObjectURL(ui.audio.src);
    ui.audio.src = URL.createObjectURL(blob);
    ui.audio.hidden = false;
    ui.go.disabled = false;
    say(ui.clip, what);
  };
  ui.file.addEventListener('change', () => {
    const f = ui.file.files && ui.file.files[0];
    if (f) useClip(f, f.name, `${f.name}, ${Math.round(f.size / 1024)} KiB`);
  });
  ui.record.addEventListener('click', () => toggleRecording(ui, state, useClip));
  ui.go.addEventListener('click', () => run(ui.go, ui.status, doors.transcription, () => transcribe(api, ui, state.clip)));
}

// Record / Stop. While recording, Transcribe waits; at RECORD_MAX_SECONDS the recording stops itself.
async function toggleRecording(ui, state, useClip) {
  const recorder = state.recorder;
  if (recorder) {
    state.recorder = null; // before the await: a second Stop (or the cap) finds nothing to stop
    const { wav, ms } = await recorder.stop();
    doors.transcription.recordedMs = ms;
    ui.record.textContent = 'Record';
    ui.record.setAttribute('aria-pressed', 'false');
    useClip(wav, 'recording.wav', `Your recording, ${seconds(ms)}.`);
    return;
  }
  const progress = (ms) => {
    doors.transcription.recordingMs = ms;
    say(ui.clip, `Recording… ${seconds(ms)} (press Stop when done)`);
  };
  const next = new MicRecorder(progress, () => { if (state.recorder === next) toggleRecording(ui, state, useClip); });
  ui.record.disabled = true;
  ui.go.disabled = true;
  try {
    await next.start();
  } catch (e) {
    next.stop().catch(() => { /* partly started */ });
    say(ui.clip, `Could not record: ${e && e.message ? e.message : e}`, true);
    ui.go.disabled = !state.clip;
    return;
  } finally {
    ui.record.disabled = false;
  }
  state.recorder = next;
  ui.file.value = ''; // the recording replaces a chosen file
  ui.record.textContent = 'Stop';
  ui.record.setAttribute('aria-pressed', 'true');
}

// The microphone alone, as a mono 16-bit WAV at the sound card's rate (the door takes any rate).
class MicRecorder {
  constructor(onProgress, onFull) {
    this.onProgress = onProgress;
    this.onFull = onFull;
  }

  async start() {
    this.stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1 } });
    this.ctx = new AudioContext();
    await this.ctx.audioWorklet.addModule(new URL('audio-worklet.js', import.meta.url));
    const capture = new AudioWorkletNode(this.ctx, 'parley-capture',
      { numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1] });
    this.recording = new Recording(this.ctx.sampleRate, RECORD_MAX_SECONDS, 1);
    capture.port.onmessage = (e) => {
      this.recording.add(0, e.data.pcm, e.data.start);
      this.onProgress(this.recording.seconds * 1000);
      if (this.recording.truncated) this.onFull();
    };
    const sink = this.ctx.createGain(); // keeps the capture node pulled; it outputs silence
    sink.gain.value = 0;
    this.ctx.createMediaStreamSource(this.stream).connect(capture);
    capture.connect(sink).connect(this.ctx.destination);
  }

  async stop() {
    if (this.stream) for (const t of this.stream.getTracks()) t.stop();
    if (this.ctx && this.ctx.state !== 'closed') await this.ctx.close();
    if (!this.recording) return null; // it never started
    return { wav: this.recording.wav(), ms: this.recording.seconds * 1000 };
  }
}

async function transcribe(api, ui, clip) {
  say(ui.status, 'Transcribing…');
  ui.text.textContent = '';
  const form = new FormData();
  form.append('file', clip.blob, clip.name);
  form.append('model', api.model);
  const t0 = performance.now();
  const r = await fetch(api.url('/v1/audio/transcriptions'), { method: 'POST', headers: api.auth, body: form });
  if (!r.ok) throw new Error(await failure(r));
  const { text } = await r.json();
  doors.transcription.text = text;
  ui.text.textContent = text;
  say(ui.status, `Transcribed by ${api.model} in ${seconds(performance.now() - t0)}.`);
}

// ---- generate an image: POST /v1/images/generations, streamed ---------------------------------

function initImage(api) {
  const ui = { prompt: $('image-prompt'), size: $('image-size'), go: $('image-go'), status: $('image-status'),
    out: $('image-out') };
  ui.out.addEventListener('load', () => {
    doors.image.width = ui.out.naturalWidth;
    doors.image.height = ui.out.naturalHeight;
    ui.out.classList.toggle('pixelated', ui.out.naturalWidth < 256); // a tiny image, shown large
  });
  ui.go.addEventListener('click', () => run(ui.go, ui.status, doors.image, () => generate(api, ui)));
}

async function generate(api, ui) {
  const prompt = ui.prompt.value.trim();
  if (!prompt) throw new Error('Describe the image to generate.');
  say(ui.status, 'Generating…');
  doors.image.partials = 0;
  const body = { model: api.model, prompt, size: ui.size.value.trim() || 'auto', stream: true,
    partial_images: IMAGE_PARTIALS };
  const t0 = performance.now();
  const r = await fetch(api.url('/v1/images/generations'), {
    method: 'POST', headers: { ...api.auth, 'Content-Type': 'application/json' }, body: JSON.stringify(body),
  });
  if (!r.ok) throw new Error(await failure(r));
  let completed = false;
  for await (const event of serverSentEvents(r.body)) {
    if (event.type === 'error') throw new Error((event.error && event.error.message) || 'the generation failed');
    if (!event.b64_json) continue;
    completed ||= event.type === 'image_generation.completed';
    ui.out.src = `data:image/${event.output_format || 'png'};base64,${event.b64_json}`;
    ui.out.alt = prompt;
    ui.out.hidden = false;
    if (event.type === 'image_generation.partial_image') {
      doors.image.partials++;
      say(ui.status, `Preview ${event.partial_image_index + 1} of up to ${IMAGE_PARTIALS}…`);
    } else if (event.type === 'image_generation.completed') {
      say(ui.status, `${event.size || ''} image by ${api.model} in ${seconds(performance.now() - t0)}`
        + ` (${doors.image.partials} previews on the way).`);
    }
  }
  if (!completed) throw new Error('The stream ended before the image was complete.');
}

// The JSON `data:` of each event of a text/event-stream body.
async function* serverSentEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += value.replace(/\r\n/g, '\n');
    let end;
    while ((end = buffered.indexOf('\n\n')) >= 0) {
      const block = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      const data = block.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart()).join('\n');
      if (data) yield JSON.parse(data);
    }
  }
}
