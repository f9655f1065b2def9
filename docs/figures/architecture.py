"""Draws docs/figures/architecture.svg, the picture at the top of docs/architecture.md.

    python docs/figures/architecture.py            # rewrites architecture.svg beside this file

The picture is data: LAYERS below, top to bottom, each a band of boxes; every band talks to the
one under it. tests/test_docs.py renders it and fails if the committed SVG differs, so the picture
cannot drift from this source. Plain SVG, no dependencies."""

from __future__ import annotations

import sys
from html import escape
from pathlib import Path

# (band title, band note, boxes); a box is (title, lines under it)
LAYERS = [
    ("clients", "browsers, SDKs, agents", [
        ("the page at /", ["WebRTC or WebSocket"]),
        ("Moshi clients", ["/api/chat"]),
        ("OpenAI SDKs", ["Realtime, GPT-Live,", "translations, audio, images"]),
        ("Kyutai clients", ["/api/asr-streaming,", "/api/tts_streaming"]),
    ]),
    ("edge (realtime/)", "edge worker processes (--edge-workers) on one port", [
        ("server/", ["CLI, supervisor, app,", "launch, drain, workers"]),
        ("doors", ["chat/  realtime_api/  live/", "translation/  kyutai/  http/"]),
        ("session parts", ["sessions/  calls/"]),
        ("per worker", ["webrtc/ peers,", "media/ Ogg-Opus codec"]),
    ]),
    ("engine client", "engine_client.py: plain messages; across processes: socket + rings", [
        ("duplex sessions", ["open, audio in,", "frames + text out, close"]),
        ("requests", ["speech, transcription,", "images: submit, events, cancel"]),
        ("counters", ["/metrics, /load"]),
    ]),
    ("engine (engine/)", "the engine process: one thread owns the GPU; a tick every 80 ms", [
        ("tick", ["plan -> step -> route", "every live session, one graph"]),
        ("slack after the tick", ["prefill, TTS, STT,", "images: one row pool"]),
        ("output streams", ["bounded, per session", "and per request"]),
    ]),
    ("models (models/)", "per-row state on the device, no host sync in a frame", [
        ("Mimi", ["codec, 12.5 Hz"]),
        ("LM + depformer", ["Moshi, PersonaPlex,", "Hibiki"]),
        ("Kyutai STT, DSM TTS", []),
        ("diffusion", ["SD / SD3 steppers"]),
    ]),
]

WIDTH, BAND_H, GAP, PAD, LABEL_W = 980, 96, 26, 10, 170
BOX_FILL = ("#e8f0fe", "#fef7e0", "#e6f4ea", "#fce8e6", "#f3e8fd")


def render() -> str:
    height = len(LAYERS) * (BAND_H + GAP) + PAD
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">',
           '<defs><marker id="arrow" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
           '<path d="M0,0 L10,4 L0,8 z" fill="#555"/></marker></defs>',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>']
    for i, (title, note, boxes) in enumerate(LAYERS):
        y = PAD + i * (BAND_H + GAP)
        out.append(f'<text x="{PAD}" y="{y + 30}" font-size="15" font-weight="bold">{escape(title)}</text>')
        out += _wrapped(note, PAD, y + 50, 12, "#555", LABEL_W - 2 * PAD)
        box_w = (WIDTH - LABEL_W - PAD - (len(boxes) - 1) * PAD) / len(boxes)
        for j, (name, lines) in enumerate(boxes):
            x = LABEL_W + j * (box_w + PAD)
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{box_w:.1f}" height="{BAND_H}" rx="8" '
                       f'fill="{BOX_FILL[i % len(BOX_FILL)]}" stroke="#888"/>')
            out.append(f'<text x="{x + box_w / 2:.1f}" y="{y + 28}" font-size="14" font-weight="bold" '
                       f'text-anchor="middle">{escape(name)}</text>')
            for k, line in enumerate(lines):
                out.append(f'<text x="{x + box_w / 2:.1f}" y="{y + 50 + 17 * k}" font-size="12" '
                           f'text-anchor="middle">{escape(line)}</text>')
        if i + 1 < len(LAYERS):
            mid = LABEL_W + (WIDTH - LABEL_W) / 2
            out.append(f'<line x1="{mid:.1f}" y1="{y + BAND_H}" x2="{mid:.1f}" y2="{y + BAND_H + GAP - 2}" '
                       'stroke="#555" stroke-width="2" marker-end="url(#arrow)"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _wrapped(text: str, x: float, y: float, size: int, color: str, width: float) -> list[str]:
    """The note in lines of about `width` pixels (a character is about 0.55 em)."""
    per_line = max(1, int(width / (0.55 * size)))
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > per_line:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    lines.append(line)
    return [f'<text x="{x}" y="{y + (size + 3) * k}" font-size="{size}" fill="{color}">{escape(t)}</text>'
            for k, t in enumerate(lines)]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_suffix(".svg")
    target.write_text(render())
    print(f"wrote {target}")
