// The official openai Node SDK (the version package.json pins) against a Parley served over TLS:
// a /v1/realtime session, speech, transcription and an image. Prints one JSON line of what came
// back and writes the speech (speech.wav) and the image (image.png) into OUT_DIR;
// tests/test_node_sdk.py starts the server and checks them.
//
//   NODE_EXTRA_CA_CERTS=cert.pem node [--experimental-websocket] openai_sdk.mjs https://localhost:PORT/v1 OUT_DIR
//
// The SDK's Realtime client always connects with wss: (it rewrites the base URL's scheme), so
// the server must serve TLS with a certificate Node trusts. Node 22 has a global WebSocket;
// Node 20 needs --experimental-websocket.

import { writeFile } from 'node:fs/promises';
import { join } from 'node:path';

import OpenAI, { toFile } from 'openai';
import { OpenAIRealtimeWebSocket } from 'openai/realtime/websocket';
import { VERSION } from 'openai/version';

const [baseURL, outDir] = process.argv.slice(2);
if (!baseURL || !outDir) {
  console.error('usage: node openai_sdk.mjs https://HOST:PORT/v1 OUT_DIR');
  process.exit(2);
}
const client = new OpenAI({ apiKey: 'unused', baseURL });

const FRAME = 1920; // 80 ms at 24 kHz

function noiseFrame(amplitude) {
  const pcm = Buffer.alloc(FRAME * 2);
  for (let i = 0; i < FRAME; i++) {
    pcm.writeInt16LE(Math.round((Math.random() * 2 - 1) * amplitude * 32767), i * 2);
  }
  return pcm.toString('base64');
}

// Realtime: stream audio in, count the agent's audio deltas (the demo model babbles, so its
// speech opens responses on its own).
async function realtime() {
  const rt = new OpenAIRealtimeWebSocket({ model: 'parley' }, client);
  const seen = { url: rt.url.toString(), session_created: false, audio_deltas: 0, audio_bytes: 0 };
  await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`realtime: ${JSON.stringify(seen)} after 30 s`)), 30_000);
    let sender = null;
    rt.on('error', (err) => {
      clearInterval(sender);
      clearTimeout(timer);
      reject(new Error(`realtime error: ${err.message ?? err}`));
    });
    rt.on('session.created', () => {
      seen.session_created = true;
      sender = setInterval(() => rt.send({ type: 'input_audio_buffer.append', audio: noiseFrame(0.1) }), 80);
    });
    rt.on('response.output_audio.delta', (event) => {
      seen.audio_deltas += 1;
      seen.audio_bytes += Buffer.from(event.delta, 'base64').length;
      if (seen.audio_deltas >= 5) {
        clearInterval(sender);
        clearTimeout(timer);
        resolve();
      }
    });
    rt.socket.addEventListener('close', (event) => {
      clearInterval(sender);
      clearTimeout(timer);
      reject(new Error(`realtime closed ${event.code} ${event.reason}: ${JSON.stringify(seen)}`));
    });
  });
  rt.close();
  return seen;
}

async function speech() {
  const response = await client.audio.speech.create({
    model: 'tts-1', input: 'Hello from Node.', voice: 'alloy', response_format: 'wav',
  });
  const wav = Buffer.from(await response.arrayBuffer());
  await writeFile(join(outDir, 'speech.wav'), wav);
  return wav;
}

async function transcription(wav) {
  const result = await client.audio.transcriptions.create({ model: 'whisper-1', file: await toFile(wav, 'speech.wav') });
  return result.text;
}

// `seed` is Parley's extension (docs/images.md): the test asks for the same image from Python.
async function image() {
  const result = await client.images.generate({ prompt: 'a lighthouse', size: 'auto', quality: 'low', seed: 1234 });
  await writeFile(join(outDir, 'image.png'), Buffer.from(result.data[0].b64_json, 'base64'));
  return result.data.length;
}

const out = { node: process.versions.node, sdk: VERSION };
out.realtime = await realtime();
const wav = await speech();
out.speech_bytes = wav.length;
out.transcription = await transcription(wav);
out.images = await image();
console.log(JSON.stringify(out));
