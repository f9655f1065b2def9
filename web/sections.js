// Parley web client: the sections below the voice chat, one for each other thing the server serves.
//
// Each section calls its public door exactly as any client would (an OpenAI SDK, curl): the same
// path, a JSON or multipart body naming `model`, the key as `Authorization: Bearer`, and OpenAI's
// error shape read back and shown. A section shows only when GET /v1/models lists a model of its
// modality, and it names that modality's first model (the checkpoint's own name). Nothing here
// knows how the server works inside.
//
// Adding a section: its markup in index.html, hidden, and an entry in SECTIONS naming the modality
// /v1/models lists for it and the function that wires it. A server whose model translates (Hibiki)
// lists no conversational (duplex) model: the conversation's cards are hidden, its doors refuse.

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
  translation: { state: 'idle', message: '', sentMs: 0, audioMs: 0, text: '', errors: [], closed: false, ms: 0 },
};
window.parleyDoors = doors;

const SECTIONS = [
  { modality: 'tts', id: 'speech-section', init: initSpeech },
  { modality: 'stt', id: 'transcribe-section', init: initTranscription },
  { modality: 'image', id: 'image-section', init: initImage },
  { modality: 'translation', id: 'translate-section', init: initTranslation },
];

const $ = (id) => document.getElementById(id);

// `base`: the server's address (URL); `key`: its API key or null.
export async function initSections({ base, key }) {
  const api = { url: (path) => new URL(path, base), auth: key ? { Authorization: `Bearer ${key}` } : {}, key };
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
  if (names.translation && !names.duplex) $('chat').hidden = true; // a translating model converses with no one
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

// ---- translate speech: WS /v1/realtime/translations, as the openai SDK speaks it ----------------

const TRANSLATE_RATE = 24000; // the door's PCM16 rate, both ways
const TRANSLATE_CHUNK = TRANSLATE_RATE / 5; // 200 ms appends, as the SDK documents
const TRANSLATE_AHEAD = 3; // chunks of a file sent before pacing in real time (the network's jitter)

function initTranslation(api) {
  const ui = { file: $('translate-file'), go: $('translate-go'), mic: $('translate-mic'),
    status: $('translate-status'), text: $('translate-text'), audio: $('translate-audio') };
  const state = { file: null, mic: null };
  ui.file.addEventListener('change', () => {
    state.file = (ui.file.files && ui.file.files[0]) || null;
    ui.go.disabled = !state.file;
  });
  ui.go.addEventListener('click', () => run(ui.go, ui.status, doors.translation,
    () => translateFile(api, ui, state.file)));
  ui.mic.addEventListener('click', () => toggleMicTranslation(api, ui, state));
}

// One session: its source in, its translation played as it comes and kept for the player, its
// transcript shown. `done` settles when the server sends session.closed (or the socket closes).
class Translation {
  constructor(api, ui) {
    this.ui = ui;
    this.ctx = new AudioContext({ sampleRate: TRANSLATE_RATE });
    this.playAt = 0;
    this.out = new Recording(TRANSLATE_RATE, RECORD_MAX_SECONDS * 10, 1);
    this.outSamples = 0;
    Object.assign(doors.translation, { sentMs: 0, audioMs: 0, text: '', errors: [], closed: false });
    ui.text.textContent = '';
    const url = api.url('/v1/realtime/translations');
    url.protocol = url.protocol === 'https:' ? 'wss:' : 'ws:';
    url.searchParams.set('model', api.model);
    this.ws = new WebSocket(url, api.key ? ['realtime', `openai-insecure-api-key.${api.key}`] : []);
    this.ready = new Promise((resolve, reject) => { this.onReady = resolve; this.onFail = reject; });
    this.done = new Promise((resolve, reject) => { this.onDone = resolve; this.onLost = reject; });
    this.ws.onmessage = (e) => this.onEvent(JSON.parse(e.data));
    this.ws.onclose = (e) => {
      const why = new Error(`The connection closed (${e.code}${e.reason ? `: ${e.reason}` : ''}).`);
      this.onFail(why);
      if (doors.translation.closed) this.onDone(); else this.onLost(why);
    };
  }

  onEvent(event) {
    if (event.type === 'session.created') this.onReady();
    else if (event.type === 'session.output_audio.delta') this.play(event.delta);
    else if (event.type === 'session.output_transcript.delta') {
      doors.translation.text += event.delta;
      this.ui.text.textContent = doors.translation.text;
    } else if (event.type === 'error') {
      doors.translation.errors.push(event.error.message);
      say(this.ui.status, event.error.message, true);
    } else if (event.type === 'session.closed') doors.translation.closed = true;
  }

  play(b64) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const s16 = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
    const pcm = Float32Array.from(s16, (v) => v / 32768);
    this.out.add(0, pcm, this.outSamples / TRANSLATE_RATE);
    this.outSamples += pcm.length;
    doors.translation.audioMs = (this.outSamples / TRANSLATE_RATE) * 1000;
    const buffer = this.ctx.createBuffer(1, pcm.length, TRANSLATE_RATE);
    buffer.copyToChannel(pcm, 0);
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    this.playAt = Math.max(this.playAt, this.ctx.currentTime + 0.1); // a short hold-off after a gap
    source.start(this.playAt);
    this.playAt += buffer.duration;
  }

  send(pcm) {
    const s16 = Int16Array.from(pcm, (v) => Math.max(-32768, Math.min(32767, Math.round(v * 32767))));
    const bytes = new Uint8Array(s16.buffer);
    let text = '';
    for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    this.ws.send(JSON.stringify({ type: 'session.input_audio_buffer.append', audio: btoa(text) }));
    doors.translation.sentMs += (pcm.length / TRANSLATE_RATE) * 1000;
  }

  // session.close: the server translates what it still owes, then session.closed and close 1000.
  async finish() {
    this.ws.send(JSON.stringify({ type: 'session.close' }));
    await this.done;
    const wav = this.out.wav();
    if (this.ui.audio.src) URL.revokeObjectURL(this.ui.audio.src);
    this.ui.audio.src = URL.createObjectURL(wav);
    this.ui.audio.hidden = false;
  }
}

// A file, decoded and resampled to 24 kHz mono by the browser, streamed in real time.
async function translateFile(api, ui, file) {
  const decoder = new OfflineAudioContext(1, 1, TRANSLATE_RATE);
  const decoded = await decoder.decodeAudioData(await file.arrayBuffer());
  const pcm = decoded.getChannelData(0); // resampled to the context's rate; the first channel
  const session = new Translation(api, ui);
  await session.ready;
  const t0 = performance.now();
  for (let i = 0, n = 0; i < pcm.length; i += TRANSLATE_CHUNK, n++) {
    session.send(pcm.subarray(i, i + TRANSLATE_CHUNK));
    say(ui.status, `Translating… ${seconds(doors.translation.sentMs)} of ${seconds(decoded.duration * 1000)} sent.`);
    const due = t0 + Math.max(0, n + 1 - TRANSLATE_AHEAD) * 200;
    await new Promise((resolve) => setTimeout(resolve, Math.max(0, due - performance.now())));
  }
  say(ui.status, 'Finishing the translation…');
  await session.finish();
  say(ui.status, `${seconds(doors.translation.audioMs)} of translation by ${api.model}.`);
}

// The microphone, captured at 24 kHz (the context resamples it), until Stop.
async function toggleMicTranslation(api, ui, state) {
  const live = state.mic;
  if (live) {
    state.mic = null;
    for (const t of live.stream.getTracks()) t.stop();
    ui.mic.textContent = 'Translate the microphone';
    ui.mic.setAttribute('aria-pressed', 'false');
    say(ui.status, 'Finishing the translation…');
    await run(ui.mic, ui.status, doors.translation, async () => {
      await live.session.finish();
      say(ui.status, `${seconds(doors.translation.audioMs)} of translation by ${api.model}.`);
    });
    return;
  }
  try {
    const session = new Translation(api, ui);
    const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1 } });
    await session.ctx.audioWorklet.addModule(new URL('audio-worklet.js', import.meta.url));
    const capture = new AudioWorkletNode(session.ctx, 'parley-capture',
      { numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1] });
    await session.ready;
    capture.port.onmessage = (e) => { if (state.mic) session.send(e.data.pcm); };
    const sink = session.ctx.createGain(); // keeps the capture node pulled; it outputs silence
    sink.gain.value = 0;
    session.ctx.createMediaStreamSource(stream).connect(capture);
    capture.connect(sink).connect(session.ctx.destination);
    state.mic = { session, stream };
    Object.assign(doors.translation, { state: 'busy', message: '' });
    ui.mic.textContent = 'Stop';
    ui.mic.setAttribute('aria-pressed', 'true');
    say(ui.status, 'Translating the microphone… (press Stop to finish)');
  } catch (e) {
    Object.assign(doors.translation, { state: 'error', message: e && e.message ? e.message : String(e) });
    say(ui.status, `Could not translate the microphone: ${doors.translation.message}`, true);
  }
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
