// Parley web client: Ogg framing for Opus (RFC 3533 pages, RFC 7845 Opus mapping).
//
// OggOpusWriter turns encoded Opus packets into Ogg pages (first the OpusHead and
// OpusTags header pages, then audio pages of at most `framesPerPage` packets).
// OggReader takes arbitrary byte chunks (one or several pages per chunk, or parts of
// a page) and returns whole packets, reassembling packets continued across pages.

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    let r = i << 24;
    for (let k = 0; k < 8; k++) {
      r = r & 0x80000000 ? (r << 1) ^ 0x04c11db7 : r << 1;
    }
    table[i] = r >>> 0;
  }
  return table;
})();

// Ogg CRC32: polynomial 0x04c11db7, initial value 0, no reflection, no final xor.
export function oggCrc32(bytes) {
  let crc = 0;
  for (let i = 0; i < bytes.length; i++) {
    crc = ((crc << 8) ^ CRC_TABLE[((crc >>> 24) ^ bytes[i]) & 0xff]) >>> 0;
  }
  return crc >>> 0;
}

const OGGS = [0x4f, 0x67, 0x67, 0x53]; // "OggS"
const enc = new TextEncoder();

function startsWith(bytes, ascii) {
  if (bytes.length < ascii.length) return false;
  for (let i = 0; i < ascii.length; i++) {
    if (bytes[i] !== ascii.charCodeAt(i)) return false;
  }
  return true;
}

export function isOpusHead(packet) { return startsWith(packet, 'OpusHead'); }
export function isOpusTags(packet) { return startsWith(packet, 'OpusTags'); }

// OpusHead identification header (RFC 7845 section 5.1), channel mapping family 0.
export function makeOpusHead({ channels = 1, preSkip = 312, inputSampleRate = 24000 } = {}) {
  const b = new Uint8Array(19);
  const v = new DataView(b.buffer);
  b.set(enc.encode('OpusHead'), 0);
  b[8] = 1; // version
  b[9] = channels;
  v.setUint16(10, preSkip, true);
  v.setUint32(12, inputSampleRate, true);
  v.setInt16(16, 0, true); // output gain
  b[18] = 0; // mapping family
  return b;
}

export function parseOpusHead(packet) {
  if (!isOpusHead(packet) || packet.length < 19) return null;
  const v = new DataView(packet.buffer, packet.byteOffset, packet.byteLength);
  return {
    version: packet[8],
    channels: packet[9],
    preSkip: v.getUint16(10, true),
    inputSampleRate: v.getUint32(12, true),
  };
}

// OpusTags comment header (RFC 7845 section 5.2) with no user comments.
export function makeOpusTags(vendor = 'Parley web client') {
  const vend = enc.encode(vendor);
  const b = new Uint8Array(8 + 4 + vend.length + 4);
  const v = new DataView(b.buffer);
  b.set(enc.encode('OpusTags'), 0);
  v.setUint32(8, vend.length, true);
  b.set(vend, 12);
  v.setUint32(12 + vend.length, 0, true);
  return b;
}

// Duration of one Opus packet in 48 kHz samples, from its TOC byte (RFC 6716 3.1).
export function opusPacketSamples48k(packet) {
  if (!packet || packet.length < 1) return 0;
  const toc = packet[0];
  const config = toc >> 3;
  let frame; // in 48 kHz samples
  if (config < 12) frame = [480, 960, 1920, 2880][config & 3];
  else if (config < 16) frame = [480, 960][config & 1];
  else frame = [120, 240, 480, 960][config & 3];
  const code = toc & 3;
  let count = 1;
  if (code === 1 || code === 2) count = 2;
  else if (code === 3) count = packet.length > 1 ? packet[1] & 0x3f : 0;
  return frame * count;
}

// Build one Ogg page holding whole packets.
export function buildOggPage(packets, { granule = 0, serial = 0, sequence = 0, bos = false, eos = false } = {}) {
  const lacing = [];
  let bodyLen = 0;
  for (const p of packets) {
    let n = p.length;
    while (n >= 255) { lacing.push(255); n -= 255; }
    lacing.push(n); // a final 0 terminates packets whose length is a multiple of 255
    bodyLen += p.length;
  }
  if (lacing.length > 255) throw new Error('too many segments for one Ogg page');
  const page = new Uint8Array(27 + lacing.length + bodyLen);
  const v = new DataView(page.buffer);
  page.set(OGGS, 0);
  page[4] = 0; // stream structure version
  page[5] = (bos ? 0x02 : 0) | (eos ? 0x04 : 0);
  v.setBigInt64(6, BigInt(granule), true);
  v.setUint32(14, serial >>> 0, true);
  v.setUint32(18, sequence >>> 0, true);
  v.setUint32(22, 0, true); // CRC, filled below
  page[26] = lacing.length;
  page.set(lacing, 27);
  let off = 27 + lacing.length;
  for (const p of packets) { page.set(p, off); off += p.length; }
  v.setUint32(22, oggCrc32(page), true);
  return page;
}

export class OggOpusWriter {
  constructor({ channels = 1, inputSampleRate = 24000, framesPerPage = 1, serial } = {}) {
    this.channels = channels;
    this.inputSampleRate = inputSampleRate;
    this.framesPerPage = Math.max(1, Math.min(framesPerPage, 2 * 24)); // <= 255 segments
    this.serial = serial ?? (Math.floor(Math.random() * 0xffffffff) >>> 0);
    this.sequence = 0;
    this.granule = 0; // 48 kHz samples decoded so far, pre-skip included
    this.pending = [];
    this.headersDone = false;
  }

  // The two header pages; call once before the first audio page.
  headerPages(preSkip = 312) {
    this.headersDone = true;
    const head = buildOggPage([makeOpusHead({ channels: this.channels, preSkip, inputSampleRate: this.inputSampleRate })],
      { granule: 0, serial: this.serial, sequence: this.sequence++, bos: true });
    const tags = buildOggPage([makeOpusTags()], { granule: 0, serial: this.serial, sequence: this.sequence++ });
    return [head, tags];
  }

  // Add one Opus packet; returns a page when `framesPerPage` packets are collected, else null.
  addPacket(packet) {
    this.pending.push(packet);
    this.granule += opusPacketSamples48k(packet);
    if (this.pending.length >= this.framesPerPage) return this.flush();
    return null;
  }

  flush(eos = false) {
    if (this.pending.length === 0 && !eos) return null;
    const page = buildOggPage(this.pending, { granule: this.granule, serial: this.serial, sequence: this.sequence++, eos });
    this.pending = [];
    return page;
  }
}

export class OggReader {
  constructor({ maxBuffered = 1 << 20 } = {}) {
    this.buf = new Uint8Array(0);
    this.partial = []; // segments of a packet continued on the next page
    this.maxBuffered = maxBuffered;
    this.pages = 0;
    this.badPages = 0;
  }

  // Feed bytes; returns the list of complete packets (Uint8Array) now available.
  push(bytes) {
    if (this.buf.length === 0) {
      this.buf = bytes.slice();
    } else {
      const b = new Uint8Array(this.buf.length + bytes.length);
      b.set(this.buf, 0);
      b.set(bytes, this.buf.length);
      this.buf = b;
    }
    const packets = [];
    let pos = 0;
    const buf = this.buf;
    while (true) {
      // Find the capture pattern.
      let start = -1;
      for (let i = pos; i + 4 <= buf.length; i++) {
        if (buf[i] === 0x4f && buf[i + 1] === 0x67 && buf[i + 2] === 0x67 && buf[i + 3] === 0x53) { start = i; break; }
      }
      if (start < 0) { pos = Math.max(pos, buf.length - 3); break; }
      pos = start;
      if (buf.length - pos < 27) break;
      const nseg = buf[pos + 26];
      if (buf.length - pos < 27 + nseg) break;
      let bodyLen = 0;
      for (let i = 0; i < nseg; i++) bodyLen += buf[pos + 27 + i];
      const total = 27 + nseg + bodyLen;
      if (buf.length - pos < total) break;
      const page = buf.subarray(pos, pos + total);
      const v = new DataView(page.buffer, page.byteOffset, page.byteLength);
      const crc = v.getUint32(22, true);
      const copy = page.slice();
      copy[22] = copy[23] = copy[24] = copy[25] = 0;
      if (page[4] !== 0 || oggCrc32(copy) !== crc) {
        // Not a real page (or corrupted): skip the capture pattern and resynchronise.
        this.badPages++;
        this.partial = [];
        pos += 1;
        continue;
      }
      this.pages++;
      const headerType = page[5];
      if (!(headerType & 0x01)) this.partial = []; // not a continuation: drop any stale partial
      let off = 27 + nseg;
      for (let i = 0; i < nseg; i++) {
        const len = page[27 + i];
        this.partial.push(page.subarray(off, off + len));
        off += len;
        if (len < 255) {
          const size = this.partial.reduce((s, p) => s + p.length, 0);
          const pkt = new Uint8Array(size);
          let o = 0;
          for (const p of this.partial) { pkt.set(p, o); o += p.length; }
          this.partial = [];
          if (pkt.length > 0) packets.push(pkt);
        }
      }
      // Keep continued segments alive beyond this buffer.
      this.partial = this.partial.map((p) => p.slice());
      pos += total;
    }
    this.buf = buf.slice(pos);
    if (this.buf.length > this.maxBuffered) { this.buf = new Uint8Array(0); this.partial = []; }
    return packets;
  }
}
