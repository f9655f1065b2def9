// Parley web client: full-duplex voice chat.
//
// Where the server offers it (/api/info `webrtc`), the page calls over WebRTC: GPT-Live's
// POST /v1/live/sessions with the SDP offer; the microphone and the agent's voice travel on
// Opus tracks, the events on the `oai-events` data channel (RtcSession below). The browser's
// echo canceller cancels the agent's voice only when it arrives on a WebRTC track, so this path
// works on speakers. `?transport=websocket` (or a server without WebRTC) uses /api/chat instead:
//
// Microphone -> AudioWorklet (20 ms blocks) -> WebCodecs AudioEncoder (Opus, 24 kHz mono)
//   -> Ogg pages -> WebSocket messages tagged 0x01.
// WebSocket 0x01 -> Ogg reader -> WebCodecs AudioDecoder -> jitter buffer worklet -> speakers.
// WebSocket 0x02 -> the agent's text. 0x00 -> the session is ready (prefill done).
//
// The sections below the chat (speech, transcription, images) are sections.js's.

import { OggOpusWriter, OggReader, isOpusHead, isOpusTags, parseOpusHead, opusPacketSamples48k } from './ogg.js';
import { Resampler, levels, meterValue } from './dsp.js';
import { Recording } from './recorder.js';
import { initSections } from './sections.js';

const MODEL_RATE = 24000;
const FRAME_SAMPLES = 480; // 20 ms Opus frames, as the Moshi browser client sends
const FRAMES_PER_PAGE = 1; // one frame per Ogg page keeps the added delay lowest
const TAG_HANDSHAKE = 0x00;
const TAG_AUDIO = 0x01;
const TAG_TEXT = 0x02;
const TAG_USER_TEXT = 0x07; // with ?transcript=1: the user's words, from the server's STT
const TAG_ERROR = 0x05;
const HANDSHAKE_TIMEOUT_MS = 120000; // prefill of a long voice prompt can take a while
const SILENCE_TIMEOUT_MS = 10000; // as the Moshi client: no message for 10 s -> give up
const MAX_SEND_BUFFER = 64 * 1024; // drop microphone pages rather than queue behind a stall
const SAMPLING_PARAMS = ['text_temperature', 'text_topk', 'audio_temperature', 'audio_topk', 'pad_mult',
  'text_seed', 'audio_seed', 'repetition_penalty_context', 'repetition_penalty'];

const $ = (id) => document.getElementById(id);
const pageParams = new URLSearchParams(location.search);
const apiBase = new URL(pageParams.get('api') || location.href);
// With `parley serve --api-key KEY`, open the page as /?api_key=KEY: every request carries it
// (a browser cannot set an Authorization header on a WebSocket).
const apiKey = pageParams.get('api_key');
function apiUrl(path) {
  const u = new URL(path, apiBase);
  if (apiKey) u.searchParams.set('api_key', apiKey);
  return u;
}

// Test and debugging hooks: read-only view of what the page is doing.
const stats = {
  state: 'idle',
  message: '',
  closeCode: null,
  closeReason: '',
  sampleRate: 0,
  micFrames: 0, // 20 ms microphone frames captured
  encodedFrames: 0, // Opus packets sent
  sentPages: 0,
  sendDropped: 0,
  receivedPages: 0,
  receivedPackets: 0,
  decodedFrames: 0, // AudioData outputs of the decoder
  decodedMs: 0,
  playedFrames: 0, // decoded frames fully played by the jitter buffer
  playedMs: 0,
  bufferedMs: 0,
  avgBufferedMs: 0,
  droppedMs: 0,
  underruns: 0,
  marginMs: 0,
  outputLatencyMs: 0,
  latencyMs: 0, // added delay estimate: jitter buffer + output device + one frame
  rxRealtime: 0, // agent audio received per second of wall time, over the last 3 s (1 = real time)
  inputLevel: 0,
  inputLevelMax: 0,
  outputLevel: 0, // RMS at the analyser on the agent's audio
  outputLevelMax: 0,
  text: '', // the agent's text, as received
  userText: '', // the user's words (0x07), as received
  voices: [],
  errors: [],
  recordedMs: 0, // the conversation recording's length (both sides, as heard)
  transport: '', // 'webrtc' or 'websocket', per conversation
  echoCancellation: null, // WebRTC: what getUserMedia applied to the microphone track
  rtcPacketsSent: 0, // WebRTC: RTP packets of the microphone sent / of the agent's voice received
  rtcPacketsReceived: 0,
  prompts: true, // the model takes a persona / voice prompt (from /api/info)
};
window.parleyStats = stats;

const ui = {
  connect: $('connect'),
  mute: $('mute'),
  status: $('status'),
  statusText: $('status-text'),
  detail: $('status-detail'),
  persona: $('persona'),
  voice: $('voice'),
  download: $('download'),
  voiceNote: $('voice-note'),
  transcript: $('transcript'),
  userTranscript: $('user-transcript'),
  userPane: $('user-pane'),
  transcripts: $('transcripts'),
  clear: $('clear'),
  micBar: $('mic-meter'),
  agentBar: $('agent-meter'),
  latTotal: $('lat-total'),
  latBuffer: $('lat-buffer'),
  latDevice: $('lat-device'),
  frames: $('frames'),
  glitches: $('glitches'),
  serverNotice: $('server-notice'),
  supportNotice: $('support-notice'),
  headphones: $('headphones'),
};
const HEADPHONES_WEBRTC = 'Your browser cancels the agent\'s voice from your microphone on this connection (WebRTC). '
  + 'If your speakers or browser have no echo cancellation, wear headphones: otherwise the model hears itself.';

const STATE_TEXT = {
  idle: 'Not connected',
  connecting: 'Connecting…',
  waiting: 'Waiting for the model…',
  live: 'Live',
  full: 'Server full',
  disconnected: 'Disconnected',
  error: 'Error',
};

function setState(state, detail = '') {
  stats.state = state;
  stats.message = detail;
  ui.status.dataset.state = state;
  ui.statusText.textContent = STATE_TEXT[state] || state;
  ui.detail.textContent = detail;
  const active = state === 'connecting' || state === 'waiting' || state === 'live';
  ui.connect.textContent = active ? 'Disconnect' : 'Connect';
  ui.connect.classList.toggle('stop', active);
  ui.persona.disabled = active || !stats.prompts;
  ui.voice.disabled = active || !stats.prompts;
  ui.mute.disabled = state !== 'live';
  if (state !== 'live') setMuted(false);
  if (state === 'error') stats.errors.push(detail);
}

function setMeter(el, value) {
  const v = Math.max(0, Math.min(1, value));
  el.firstElementChild.style.transform = `scaleX(${v.toFixed(3)})`;
  el.setAttribute('aria-valuenow', String(Math.round(v * 100)));
}

let muted = false;
function setMuted(on) {
  muted = on;
  ui.mute.setAttribute('aria-pressed', String(on));
  ui.mute.textContent = on ? 'Unmute microphone' : 'Mute microphone';
}

let transcribesUser = false; // /api/info: the server can transcribe the user's side
let serverInfo = {}; // /api/info as loaded (webrtc, ice_servers, model)
function usesWebRTC() {
  return Boolean(serverInfo.webrtc) && typeof RTCPeerConnection !== 'undefined'
    && pageParams.get('transport') !== 'websocket';
}

// Both sides as text, side by side: the agent's pieces in its pane, the user's (from the
// server's STT) in theirs. Each pane follows its end unless the reader scrolled up.
function appendText(piece, speaker = 'agent') {
  if (speaker === 'agent') stats.text += piece; else stats.userText += piece;
  const t = speaker === 'agent' ? ui.transcript : ui.userTranscript;
  const atBottom = t.scrollHeight - t.scrollTop - t.clientHeight < 24;
  t.append(piece);
  if (atBottom) t.scrollTop = t.scrollHeight;
}

// The user's pane beside the agent's, where the server transcribes the user.
function showUserPane(on) {
  ui.userPane.hidden = !on;
  ui.transcripts.dataset.user = String(on);
}

function checkSupport() {
  const missing = [];
  if (!window.isSecureContext) missing.push('a secure page (https, or http on localhost)');
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) missing.push('microphone access');
  if (typeof AudioWorkletNode === 'undefined') missing.push('AudioWorklet');
  if (typeof AudioEncoder === 'undefined' || typeof AudioDecoder === 'undefined') missing.push('WebCodecs audio');
  return missing;
}

function fmtMs(x) { return `${Math.round(x)} ms`; }

// How a conversation ends, whatever carries it: the user's stop, a failure, or the server.
class Call {
  constructor({ persona, voice }) {
    this.persona = persona;
    this.voice = voice;
    this.closed = false;
    this.userClosed = false;
  }

  stop() {
    if (this.closed) return;
    this.userClosed = true;
    this.finish('disconnected', 'You ended the conversation.');
  }

  fail(message) {
    if (this.closed) return;
    this.finish('error', message);
  }

  finish(state, message) {
    this.closed = true;
    setState(state, message);
    this.teardown();
    if (session === this) session = null;
  }
}

// One conversation: microphone, audio graph, codecs and the WebSocket.
class Session extends Call {
  constructor({ persona, voice }) {
    super({ persona, voice });
    this.opened = false;
    this.ws = null;
    this.ctx = null;
    this.stream = null;
    this.encoder = null;
    this.decoder = null;
    this.writer = new OggOpusWriter({ framesPerPage: FRAMES_PER_PAGE });
    this.reader = new OggReader();
    this.micResampler = null;
    this.outResamplers = new Map();
    this.micPending = new Float32Array(FRAME_SAMPLES);
    this.micFill = 0;
    this.micTimestamp = 0;
    this.decTimestamp = 0;
    this.lastMessageAt = 0;
    this.timers = [];
    this.liveSince = 0;
    this.rxHistory = []; // [time, decodedMs] samples for the real-time factor
    this.slowShown = false;
  }

  url() {
    const u = apiUrl('/api/chat');
    u.protocol = u.protocol === 'https:' ? 'wss:' : 'ws:';
    if (stats.prompts) u.searchParams.set('text_prompt', this.persona);
    if (this.voice) u.searchParams.set('voice_prompt', this.voice);
    if (transcribesUser) u.searchParams.set('transcript', '1');
    for (const name of SAMPLING_PARAMS) {
      if (pageParams.has(name)) u.searchParams.set(name, pageParams.get(name));
    }
    return u.toString();
  }

  async start() {
    setState('connecting', 'Asking for the microphone…');
    try {
      this.stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
    } catch (e) {
      const why = e && e.name === 'NotAllowedError' ? 'Microphone permission was denied. Allow it in the address bar and try again.'
        : e && e.name === 'NotFoundError' ? 'No microphone was found.'
          : `Could not open the microphone: ${e && e.message ? e.message : e}`;
      this.fail(why);
      return;
    }
    if (this.closed) return this.teardown();
    try {
      await this.setupAudio();
      this.setupCodecs();
    } catch (e) {
      this.fail(`Audio setup failed: ${e && e.message ? e.message : e}`);
      return;
    }
    if (this.closed) return this.teardown();
    setState('connecting', 'Connecting to the server…');
    this.openSocket();
  }

  async setupAudio() {
    // Run the graph at the model's rate where the browser allows it (no resampling at all);
    // otherwise at the device rate, resampling in both directions.
    // `?rate=device` on the page's address forces the device rate (to test that path).
    let ctx = null;
    let source = null;
    try {
      if (pageParams.get('rate') === 'device') throw new Error('device rate requested');
      ctx = new AudioContext({ sampleRate: MODEL_RATE, latencyHint: 'interactive' });
      source = ctx.createMediaStreamSource(this.stream);
    } catch (e) {
      if (ctx) ctx.close();
      ctx = new AudioContext({ latencyHint: 'interactive' });
      source = ctx.createMediaStreamSource(this.stream);
    }
    this.ctx = ctx;
    stats.sampleRate = ctx.sampleRate;
    await ctx.audioWorklet.addModule(new URL('audio-worklet.js', import.meta.url));
    if (this.closed) return;
    if (ctx.sampleRate !== MODEL_RATE) this.micResampler = new Resampler(ctx.sampleRate, MODEL_RATE);

    const capture = new AudioWorkletNode(ctx, 'parley-capture', { numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1] });
    this.recording = new Recording(ctx.sampleRate);
    recording = this.recording;
    capture.port.onmessage = (e) => this.onMicBlock(e.data.pcm, e.data.start);
    source.connect(capture);
    const sink = ctx.createGain(); // keeps the capture node pulled; it outputs silence
    sink.gain.value = 0;
    capture.connect(sink).connect(ctx.destination);

    const player = new AudioWorkletNode(ctx, 'parley-player', {
      numberOfInputs: 0,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: {
        marginMs: 20, marginStepMs: 10, marginMaxMs: 60, calmMs: 5000, slackMs: 30, hardLimitMs: 200, hardKeepMs: 80, windowMs: 1000,
      },
    });
    player.port.onmessage = (e) => {
      if (e.data.played) this.onPlayed(e.data.played, e.data.time);
      else this.onPlayerStats(e.data.stats);
    };
    const analyser = ctx.createAnalyser();
    analyser.fftSize = 1024;
    player.connect(analyser).connect(ctx.destination);
    this.capture = capture;
    this.player = player;
    this.analyser = analyser;
    this.analyserBuf = new Float32Array(analyser.fftSize);
    this.source = source;
    await ctx.resume();
    this.timers.push(setInterval(() => this.tick(), 100));
  }

  setupCodecs() {
    this.encoder = new AudioEncoder({
      output: (chunk, meta) => this.onEncoded(chunk, meta),
      error: (e) => this.fail(`Opus encoder error: ${e.message || e}`),
    });
    this.encoder.configure({
      codec: 'opus',
      sampleRate: MODEL_RATE,
      numberOfChannels: 1,
      bitrate: 32000,
      opus: { frameDuration: 20000 },
    });
    this.decoder = new AudioDecoder({
      output: (data) => this.onDecoded(data),
      error: (e) => this.fail(`Opus decoder error: ${e.message || e}`),
    });
    this.decoder.configure({ codec: 'opus', sampleRate: MODEL_RATE, numberOfChannels: 1 });
  }

  openSocket() {
    let ws;
    try {
      ws = new WebSocket(this.url());
    } catch (e) {
      this.fail(`Bad server address: ${e.message || e}`);
      return;
    }
    ws.binaryType = 'arraybuffer';
    this.ws = ws;
    ws.onopen = () => {
      if (this.closed) return;
      this.opened = true;
      this.lastMessageAt = performance.now();
      this.openedAt = performance.now();
      setState('waiting', 'The server is preparing the model with your persona and voice.');
    };
    ws.onmessage = (e) => this.onMessage(e.data);
    ws.onclose = (e) => this.onClose(e);
    ws.onerror = () => { /* the close event follows and says more */ };
  }

  onMessage(data) {
    if (this.closed) return;
    this.lastMessageAt = performance.now();
    if (!(data instanceof ArrayBuffer) || data.byteLength === 0) return;
    const bytes = new Uint8Array(data);
    const tag = bytes[0];
    if (tag === TAG_HANDSHAKE) {
      if (stats.state === 'waiting') {
        this.liveSince = performance.now();
        setState('live', 'Speak whenever you like; the agent listens while it talks.');
      }
    } else if (tag === TAG_AUDIO) {
      stats.receivedPages++;
      for (const pkt of this.reader.push(bytes.subarray(1))) this.onPacket(pkt);
    } else if (tag === TAG_TEXT) {
      appendText(new TextDecoder().decode(bytes.subarray(1)));
    } else if (tag === TAG_USER_TEXT) {
      appendText(new TextDecoder().decode(bytes.subarray(1)), 'user');
    } else if (tag === TAG_ERROR) {
      const msg = new TextDecoder().decode(bytes.subarray(1));
      stats.errors.push(msg);
      ui.detail.textContent = `Server error: ${msg}`;
    }
    // other tags (control, metadata, ping) are ignored
  }

  onPacket(pkt) {
    if (isOpusHead(pkt)) {
      const head = parseOpusHead(pkt);
      if (head && head.channels !== 1 && this.decoder.state === 'configured') {
        this.decoder.configure({ codec: 'opus', sampleRate: MODEL_RATE, numberOfChannels: head.channels });
      }
      return;
    }
    if (isOpusTags(pkt)) return;
    stats.receivedPackets++;
    if (!this.decoder || this.decoder.state !== 'configured') return;
    const dur48 = opusPacketSamples48k(pkt) || 960;
    this.decoder.decode(new EncodedAudioChunk({ type: 'key', timestamp: this.decTimestamp, data: pkt }));
    this.decTimestamp += Math.round((dur48 / 48000) * 1e6);
  }

  onDecoded(data) {
    try {
      if (this.closed || !this.player) return;
      const n = data.numberOfFrames;
      const pcm = new Float32Array(n);
      data.copyTo(pcm, { planeIndex: 0, format: 'f32-planar' });
      stats.decodedFrames++;
      stats.decodedMs += (n / data.sampleRate) * 1000;
      let out = pcm;
      if (data.sampleRate !== this.ctx.sampleRate) {
        let r = this.outResamplers.get(data.sampleRate);
        if (!r) { r = new Resampler(data.sampleRate, this.ctx.sampleRate); this.outResamplers.set(data.sampleRate, r); }
        out = r.process(pcm).slice();
      }
      this.player.port.postMessage({ pcm: out }, [out.buffer]);
    } finally {
      data.close();
    }
  }

  onPlayerStats(s) {
    if (!s) return;
    stats.bufferedMs = s.bufferedMs;
    stats.avgBufferedMs = s.avgBufferedMs;
    stats.playedFrames = s.playedChunks;
    stats.playedMs = (s.playedSamples / this.ctx.sampleRate) * 1000;
    stats.droppedMs = s.droppedMs;
    stats.underruns = s.underruns;
    stats.marginMs = s.marginMs;
  }

  onMicBlock(block, start) {
    if (this.closed) return;
    const { rms } = levels(block);
    stats.inputLevel = rms;
    if (rms > stats.inputLevelMax) stats.inputLevelMax = rms;
    // Audio before the handshake is discarded, as in the Moshi client.
    if (stats.state !== 'live' || !this.encoder || this.encoder.state !== 'configured') return;
    this.recording.add(0, muted ? new Float32Array(block.length) : block, start);
    this.onRecorded();
    let pcm = this.micResampler ? this.micResampler.process(block) : block;
    if (muted) pcm = new Float32Array(pcm.length);
    let i = 0;
    while (i < pcm.length) {
      const n = Math.min(pcm.length - i, FRAME_SAMPLES - this.micFill);
      this.micPending.set(pcm.subarray(i, i + n), this.micFill);
      this.micFill += n;
      i += n;
      if (this.micFill === FRAME_SAMPLES) {
        const frame = new AudioData({
          format: 'f32', sampleRate: MODEL_RATE, numberOfFrames: FRAME_SAMPLES, numberOfChannels: 1,
          timestamp: this.micTimestamp, data: this.micPending,
        });
        this.micTimestamp += (FRAME_SAMPLES / MODEL_RATE) * 1e6;
        this.micFill = 0;
        stats.micFrames++;
        this.encoder.encode(frame);
        frame.close();
      }
    }
  }

  onEncoded(chunk, meta) {
    if (this.closed || !this.ws || this.ws.readyState !== WebSocket.OPEN) return;
    const pkt = new Uint8Array(chunk.byteLength);
    chunk.copyTo(pkt);
    if (!this.writer.headersDone) {
      let preSkip = 312;
      const desc = meta && meta.decoderConfig && meta.decoderConfig.description;
      if (desc) {
        const head = parseOpusHead(new Uint8Array(desc instanceof ArrayBuffer ? desc : desc.buffer));
        if (head) preSkip = head.preSkip;
      }
      for (const page of this.writer.headerPages(preSkip)) this.send(page, true);
    }
    stats.encodedFrames++;
    const page = this.writer.addPacket(pkt);
    if (page) this.send(page, false);
  }

  send(page, mustSend) {
    if (!mustSend && this.ws.bufferedAmount > MAX_SEND_BUFFER) { stats.sendDropped++; return; }
    const msg = new Uint8Array(page.length + 1);
    msg[0] = TAG_AUDIO;
    msg.set(page, 1);
    this.ws.send(msg);
    stats.sentPages++;
  }

  tick() {
    if (this.closed) return;
    const now = performance.now();
    if (this.analyser) {
      this.analyser.getFloatTimeDomainData(this.analyserBuf);
      const { rms } = levels(this.analyserBuf);
      stats.outputLevel = rms;
      if (rms > stats.outputLevelMax) stats.outputLevelMax = rms;
      setMeter(ui.agentBar, meterValue(rms));
    }
    setMeter(ui.micBar, muted ? 0 : meterValue(stats.inputLevel));
    const dev = this.ctx ? (this.ctx.outputLatency || this.ctx.baseLatency || 0) * 1000 : 0;
    stats.outputLatencyMs = dev;
    if (stats.state === 'live') {
      stats.latencyMs = stats.avgBufferedMs + dev + (FRAME_SAMPLES / MODEL_RATE) * 1000;
      ui.latTotal.textContent = `≈ ${fmtMs(stats.latencyMs)}`;
      ui.latBuffer.textContent = `${fmtMs(stats.avgBufferedMs)}`;
      ui.latDevice.textContent = fmtMs(dev);
      ui.frames.textContent = `${stats.encodedFrames} / ${stats.decodedFrames}`;
      ui.glitches.textContent = `${stats.underruns} · ${fmtMs(stats.droppedMs)}`;
      this.checkPace(now);
      if (now - this.lastMessageAt > SILENCE_TIMEOUT_MS) {
        this.fail('The server stopped responding (nothing received for 10 s).');
      }
    } else if (stats.state === 'waiting' && now - this.openedAt > HANDSHAKE_TIMEOUT_MS) {
      this.fail('The model did not become ready in time.');
    }
  }

  // Warn when the server delivers audio slower than real time (a model too big for its
  // hardware, an overloaded machine): the jitter buffer cannot hide that.
  checkPace(now) {
    const h = this.rxHistory;
    h.push([now, stats.decodedMs]);
    while (h.length > 1 && now - h[0][0] > 3000) h.shift();
    if (now - this.liveSince < 3500 || now - h[0][0] < 2500) return;
    const factor = (stats.decodedMs - h[0][1]) / (now - h[0][0]);
    stats.rxRealtime = factor;
    const slow = factor < 0.85;
    if (slow) {
      ui.detail.textContent = `The server is running behind real time (${factor.toFixed(2)}×): expect gaps in the agent's voice.`;
    } else if (this.slowShown) {
      ui.detail.textContent = stats.message;
    }
    this.slowShown = slow;
  }

  onClose(e) {
    stats.closeCode = e.code;
    stats.closeReason = e.reason || '';
    if (this.closed) return;
    const reason = e.reason ? `: ${e.reason}` : '';
    if (e.code === 1013) {
      this.finish('full', `Every conversation slot is busy (code 1013${reason}). Try again in a moment.`);
    } else if (!this.opened) {
      // A full or draining server refuses the upgrade with HTTP 503, which a browser reports
      // only as a failed connection: ask /readyz which it was.
      fetch(apiUrl('/readyz')).then((r) => r.json()).then((ready) => {
        if (this.closed) return;
        if (ready.draining) {
          this.finish('full', 'This server is shutting down and takes no new conversations. Try again in a moment.');
        } else if (ready.free === 0) {
          this.finish('full', 'Every conversation slot is busy (the server answered 503). Try again in a moment.');
        } else {
          this.finish('error', `Could not connect to the server (code ${e.code}${reason}).`);
        }
      }).catch(() => {
        if (!this.closed) {
          this.finish('error', `Could not connect to the server (code ${e.code}${reason}). Is it running, and is this its address?`);
        }
      });
    } else if (stats.state === 'waiting') {
      this.finish('error', `The server closed the connection before the model was ready (code ${e.code}${reason}).`);
    } else {
      this.finish('disconnected', `The server ended the conversation (code ${e.code}${reason}).`);
    }
  }

  // The agent as played; recorded from the first live moment on, like the microphone.
  onPlayed(pcm, time) {
    if (this.closed || stats.state !== 'live') return;
    this.recording.add(1, pcm, time);
    this.onRecorded();
  }

  onRecorded() {
    stats.recordedMs = this.recording.seconds * 1000;
    ui.download.disabled = false;
  }

  teardown() {
    this.closed = true;
    for (const t of this.timers) clearInterval(t);
    this.timers = [];
    if (this.ws && (this.ws.readyState === WebSocket.OPEN || this.ws.readyState === WebSocket.CONNECTING)) {
      try { this.ws.close(1000, 'client closed'); } catch (_) { /* already closing */ }
    }
    if (this.stream) for (const t of this.stream.getTracks()) t.stop();
    for (const c of [this.encoder, this.decoder]) {
      if (c && c.state !== 'closed') { try { c.close(); } catch (_) { /* ignore */ } }
    }
    if (this.ctx && this.ctx.state !== 'closed') this.ctx.close();
    setMeter(ui.micBar, 0);
    setMeter(ui.agentBar, 0);
    stats.inputLevel = 0;
    stats.outputLevel = 0;
  }
}

// One conversation over WebRTC (GPT-Live's WebRTC door): the browser does the codecs, echo
// cancellation and jitter buffering; the page only signals, meters and shows the events.
class RtcSession extends Call {
  constructor({ persona, voice }) {
    super({ persona, voice });
    this.pc = null;
    this.channel = null;
    this.stream = null;
    this.ctx = null;
    this.timers = [];
    this.audio = null;
  }

  async start() {
    setState('connecting', 'Asking for the microphone…');
    try {
      this.stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
    } catch (e) {
      this.fail(e && e.name === 'NotAllowedError' ? 'Microphone permission was denied. Allow it in the address bar and try again.'
        : `Could not open the microphone: ${e && e.message ? e.message : e}`);
      return;
    }
    if (this.closed) return this.teardown();
    const track = this.stream.getAudioTracks()[0];
    stats.echoCancellation = track.getSettings().echoCancellation === true;
    this.setupMeters();
    const pc = new RTCPeerConnection({ iceServers: serverInfo.ice_servers || [] });
    this.pc = pc;
    pc.addTrack(track, this.stream);
    this.channel = pc.createDataChannel('oai-events');
    this.channel.onmessage = (e) => this.onEvent(e.data);
    this.channel.onclose = () => { if (!this.closed) this.finish('disconnected', 'The server ended the conversation.'); };
    pc.ontrack = (e) => this.onTrack(e);
    pc.onconnectionstatechange = () => {
      if (!this.closed && pc.connectionState === 'failed') this.fail('The connection to the server failed (WebRTC).');
    };
    await pc.setLocalDescription(await pc.createOffer());
    await this.gathered();
    if (this.closed) return this.teardown();
    setState('connecting', 'Calling the server…');
    const session = { model: serverInfo.model || 'parley' };
    if (stats.prompts && this.persona) session.instructions = this.persona;
    if (this.voice) session.audio = { output: { voice: this.voice } };
    let reply;
    try {
      reply = await fetch(apiUrl('/v1/live/sessions'), {
        method: 'POST',
        headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ session, transport: { type: 'webrtc', sdp: pc.localDescription.sdp } }),
      });
    } catch (e) {
      this.fail(`Could not reach the server: ${e && e.message ? e.message : e}`);
      return;
    }
    const body = await reply.json().catch(() => ({}));
    if (this.closed) return this.teardown();
    if (reply.status === 503) {
      this.finish('full', `Every conversation slot is busy (${(body.error && body.error.message) || 'HTTP 503'}). Try again in a moment.`);
      return;
    }
    if (!reply.ok || !body.transport) {
      this.fail(`The server refused the call: ${(body.error && body.error.message) || `HTTP ${reply.status}`}`);
      return;
    }
    stats.closeCode = null;
    await pc.setRemoteDescription({ type: 'answer', sdp: body.transport.sdp });
    setState('waiting', 'The server is preparing the model with your persona and voice.');
  }

  // The server answers the whole offer at once (no trickle ICE): wait for the host candidates.
  gathered() {
    if (this.pc.iceGatheringState === 'complete') return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => { if (this.pc && this.pc.iceGatheringState === 'complete') resolve(); };
      this.pc.addEventListener('icegatheringstatechange', done);
      setTimeout(resolve, 3000); // whatever was gathered by then
    });
  }

  setupMeters() {
    this.ctx = new AudioContext({ latencyHint: 'interactive' });
    stats.sampleRate = this.ctx.sampleRate;
    this.micAnalyser = this.ctx.createAnalyser();
    this.ctx.createMediaStreamSource(this.stream).connect(this.micAnalyser);
    this.buf = new Float32Array(1024);
    this.timers.push(setInterval(() => this.tick(), 100));
  }

  onTrack(e) {
    const stream = e.streams[0] || new MediaStream([e.track]);
    // Played by a media element: the echo canceller knows what the speakers say.
    this.audio = new Audio();
    this.audio.autoplay = true;
    this.audio.srcObject = stream;
    this.audio.play().catch(() => { /* autoplay needs the click that started the call: it had one */ });
    this.agentAnalyser = this.ctx.createAnalyser();
    this.ctx.createMediaStreamSource(stream).connect(this.agentAnalyser);
  }

  onEvent(data) {
    if (this.closed) return;
    let event;
    try { event = JSON.parse(data); } catch (_) { return; }
    if (event.type === 'session.started') {
      setState('live', 'Speak whenever you like; the agent listens while it talks.');
    } else if (event.type === 'session.output_transcript.delta') {
      appendText(event.delta || '');
    } else if (event.type === 'session.input_transcript.delta') {
      appendText(event.delta || '', 'user');
    } else if (event.type === 'error') {
      const msg = (event.error && event.error.message) || 'error';
      stats.errors.push(msg);
      ui.detail.textContent = `Server error: ${msg}`;
    } else if (event.type === 'session.closed') {
      this.finish('disconnected', 'The server ended the conversation.');
    }
  }

  async tick() {
    if (this.closed) return;
    for (const [analyser, key, bar] of [[this.micAnalyser, 'input', ui.micBar], [this.agentAnalyser, 'output', ui.agentBar]]) {
      if (!analyser) continue;
      analyser.getFloatTimeDomainData(this.buf);
      const { rms } = levels(this.buf);
      stats[`${key}Level`] = rms;
      if (rms > stats[`${key}LevelMax`]) stats[`${key}LevelMax`] = rms;
      setMeter(bar, key === 'input' && muted ? 0 : meterValue(rms));
    }
    const track = this.stream && this.stream.getAudioTracks()[0];
    if (track) track.enabled = !muted;
    if (!this.pc || stats.state !== 'live') return;
    const report = await this.pc.getStats();
    report.forEach((r) => {
      if (r.type === 'outbound-rtp' && r.kind === 'audio') stats.rtcPacketsSent = r.packetsSent || 0;
      if (r.type === 'inbound-rtp' && r.kind === 'audio') {
        stats.rtcPacketsReceived = r.packetsReceived || 0;
        stats.latencyMs = (r.jitterBufferDelay && r.jitterBufferEmittedCount)
          ? (r.jitterBufferDelay / r.jitterBufferEmittedCount) * 1000 : 0;
      }
    });
    ui.latTotal.textContent = `≈ ${fmtMs(stats.latencyMs)}`;
    ui.latBuffer.textContent = fmtMs(stats.latencyMs);
    ui.latDevice.textContent = '–';
    ui.frames.textContent = `${stats.rtcPacketsSent} / ${stats.rtcPacketsReceived}`;
  }

  teardown() {
    this.closed = true;
    for (const t of this.timers) clearInterval(t);
    this.timers = [];
    if (this.channel && this.channel.readyState === 'open') {
      try { this.channel.send(JSON.stringify({ type: 'session.close' })); } catch (_) { /* closing */ }
    }
    if (this.pc) this.pc.close();
    if (this.audio) this.audio.srcObject = null;
    if (this.stream) for (const t of this.stream.getTracks()) t.stop();
    if (this.ctx && this.ctx.state !== 'closed') this.ctx.close();
    setMeter(ui.micBar, 0);
    setMeter(ui.agentBar, 0);
  }
}

let session = null;
let recording = null; // the last conversation's, downloadable after it ends too

function downloadRecording() {
  if (!recording || !recording.length) return;
  const url = URL.createObjectURL(recording.wav());
  const a = document.createElement('a');
  const stamp = new Date().toISOString().replace(/[:.]/g, '-').slice(0, 19);
  a.href = url;
  a.download = `parley-${stamp}.wav`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function resetStats() {
  Object.assign(stats, {
    closeCode: null, closeReason: '', micFrames: 0, encodedFrames: 0, sentPages: 0, sendDropped: 0,
    receivedPages: 0, receivedPackets: 0, decodedFrames: 0, decodedMs: 0, playedFrames: 0, playedMs: 0,
    bufferedMs: 0, avgBufferedMs: 0, droppedMs: 0, underruns: 0, latencyMs: 0, rxRealtime: 0, inputLevelMax: 0,
    outputLevelMax: 0, recordedMs: 0, transport: '', echoCancellation: null, rtcPacketsSent: 0, rtcPacketsReceived: 0,
  });
  for (const el of [ui.latTotal, ui.latBuffer, ui.latDevice, ui.frames, ui.glitches]) el.textContent = '–';
}

function connect() {
  if (session) return;
  const missing = checkSupport();
  if (missing.length) {
    setState('error', `This browser or page lacks ${missing.join(', ')}.`);
    return;
  }
  const persona = stats.prompts ? ui.persona.value.trim() : '';
  const voice = stats.prompts ? ui.voice.value : '';
  try {
    localStorage.setItem('parley.persona', persona);
    localStorage.setItem('parley.voice', voice);
  } catch (_) { /* storage may be off */ }
  resetStats();
  session = usesWebRTC() ? new RtcSession({ persona, voice }) : new Session({ persona, voice });
  stats.transport = session instanceof RtcSession ? 'webrtc' : 'websocket';
  session.start().catch((e) => session && session.fail(String(e && e.message ? e.message : e)));
}

function disconnect() {
  if (session) session.stop();
}

ui.connect.addEventListener('click', () => (session ? disconnect() : connect()));
ui.mute.addEventListener('click', () => setMuted(!muted));
ui.clear.addEventListener('click', () => {
  ui.transcript.textContent = '';
  ui.userTranscript.textContent = '';
  stats.text = '';
  stats.userText = '';
});
ui.download.addEventListener('click', downloadRecording);
document.addEventListener('keydown', (e) => {
  if (e.key === 'Escape' && session) { e.preventDefault(); disconnect(); return; }
  const inField = e.target instanceof HTMLElement && e.target.matches('textarea, input, select');
  if (!inField && (e.key === 'm' || e.key === 'M') && !e.ctrlKey && !e.metaKey && !e.altKey && stats.state === 'live') {
    e.preventDefault();
    setMuted(!muted);
  }
});

// Voice list: accepts ["a.pt", ...], [{name|id, label?}, ...] or {voices: [...], default?}.
async function loadVoices() {
  let saved = '';
  try {
    ui.persona.value = localStorage.getItem('parley.persona') || '';
    saved = localStorage.getItem('parley.voice') || '';
  } catch (_) { /* storage may be off */ }
  try {
    const r = await fetch(apiUrl('/api/voices'), { headers: { Accept: 'application/json' } });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const body = await r.json();
    const list = Array.isArray(body) ? body : (body && Array.isArray(body.voices) ? body.voices : []);
    const def = body && !Array.isArray(body) ? body.default : undefined;
    const voices = list.map((v) => (typeof v === 'string' ? { id: v, label: v }
      : { id: String(v.id ?? v.name ?? v.file ?? ''), label: String(v.label ?? v.name ?? v.id ?? v.file ?? '') }))
      .filter((v) => v.id);
    stats.voices = voices.map((v) => v.id);
    for (const v of voices) {
      const opt = document.createElement('option');
      opt.value = v.id;
      opt.textContent = v.label;
      ui.voice.append(opt);
    }
    if (def) ui.voice.options[0].textContent = `Server default (${def})`;
    if (saved && voices.some((v) => v.id === saved)) ui.voice.value = saved;
    ui.voiceNote.textContent = voices.length ? '' : 'This server lists no voices.';
  } catch (e) {
    ui.voiceNote.textContent = 'Could not load the voice list; the server default is used.';
  }
}

// Optional server information (for example that a demo model is loaded).
async function loadInfo() {
  try {
    const r = await fetch(apiUrl('/api/info'), { headers: { Accept: 'application/json' } });
    if (!r.ok) return;
    const info = await r.json();
    if (info && info.prompts === false) { // a Moshi checkpoint: no persona, no voice prompt
      stats.prompts = false;
      ui.persona.value = '';
      ui.persona.disabled = true;
      ui.persona.placeholder = 'This model takes no persona.';
      ui.voice.disabled = true;
    }
    transcribesUser = Boolean(info && info.session_transcript);
    showUserPane(transcribesUser);
    serverInfo = info || {};
    if (usesWebRTC()) ui.headphones.textContent = HEADPHONES_WEBRTC;
    const notice = info && (info.notice || (info.demo ? 'This server runs the tiny demo model: it babbles. Start `parley serve --model ...` with real weights to talk for real.' : ''));
    if (notice) {
      ui.serverNotice.textContent = notice;
      ui.serverNotice.hidden = false;
    }
  } catch (_) { /* optional */ }
}

const missing = checkSupport();
if (missing.length) {
  ui.supportNotice.textContent = `This page needs ${missing.join(', ')}. Use a current Chrome, Edge or Firefox, over https or on localhost.`;
  ui.supportNotice.hidden = false;
}
setState('idle', '');
loadVoices();
loadInfo();
initSections({ base: apiBase, key: apiKey });
