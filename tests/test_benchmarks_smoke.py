"""Every benchmark's code path, run on the CPU with tiny shapes, so a GPU session can trust them.

The GPU benchmarks run only when device time is lent; a refactor that breaks one (a renamed
field, a missing argument, an import) would otherwise be found there, at that time's cost.
Each case runs the script as the docs do (`python benchmarks/X.py ...` from the repo root, a
subprocess with a timeout) and checks it exits 0 and prints its table / figures. The numbers
are meaningless here (tiny random models on a shared CPU); only that every path runs is checked.
Scripts whose every path needs CUDA are at least imported on CPU, and run small under `gpu`.
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import random
import re
import subprocess
import symtable
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def run_benchmark(script: str, *args: str, timeout: float = 120) -> str:
    """Run benchmarks/`script` as a user would; its combined output, after asserting exit 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} {' '.join(args)} hung past {timeout} s:\n{exc.stdout}\n{exc.stderr}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    return output


# (script, arguments, patterns its output must hold): each a table header or a figure line.
CPU_CASES = {
    "webrtc_cpu": (  # the demo server, one GPT-Live session per transport for 2 s
        "webrtc_cpu.py", ["--sessions", "1", "--seconds", "2"],
        [r"^  websocket +\d+\.\d{3} +0\.000 +\d+\.\d{3}$", r"^  webrtc +\d+\.\d{3} +\d+\.\d{3} +\d+\.\d{3}$",
         r"webrtc / websocket: server \d+\.\d\dx, total \d+\.\d\dx"]),
    "tts_load": (  # --duplex tiny: the --duplex 7b path (Checkpoint, tokenizer, ModelBackend) at tiny shapes
        "tts_load.py", ["--shapes", "tiny", "--duplex", "tiny", "--streams", "1", "--sessions", "1",
                        "--device", "cpu", "--settle", "0.2", "--idle-seconds", "0.3", "--reference",
                        "--text", "Good morning.", "--delivery", "http,direct", "--slots", "2", "--progress", "0.1"],
        [r"\| reference TTSModel streams \| first audio \(ms\) \| x real time \(median\) \|",
         r"^\| 1 \| \d+ \| \d+\.\d\d \|$",
         r"duplex backend tiny, .*HTTP clients in their own process$",  # the default: tts_clients.py as a child
         r"\| delivery \| TTS streams \| duplex sessions \| TTFB p50 / p99 \(ms\)", r"\| - \| 0 \| 1 \| nan / nan \|",
         r"\| http \| 1 \| 1 \| \d+ / \d+ \| \d+\.\d\d / \d+\.\d\d \|",
         r"\| direct \| 1 \| 1 \| \d+ / \d+ \| \d+\.\d\d / \d+\.\d\d \|",
         r"slack by item: .*full/2 \d+ x \d+\.\d ms",  # --slots 2: one stream in a 2-row pool
         r"\d s: live \d, .*clients received \d+\.\d - \d+\.\d s of audio"]),  # --progress
    "tts_load_clients_in_process": (  # the HTTP clients on the benchmark's loop, beside the server (8 s)
        "tts_load.py", ["--shapes", "tiny", "--duplex", "none", "--streams", "1", "--sessions", "0", "--device", "cpu",
                        "--settle", "0.1", "--idle-seconds", "0.1", "--text", "Hi.", "--clients-in-process",
                        "--watch-stalls", "50"],
        [r"HTTP clients in the server's process$", r"\| http \| 1 \| 0 \| \d+ / \d+ \| \d+\.\d\d / \d+\.\d\d \|"]),
    "admission_ops": ("admission_ops.py", [], [r"TtsPool\._load_row: \d+ top-level aten ops",
                                              r"TtsGen\.begin: \d+ top-level aten ops"]),
    "stt": (
        "stt.py", ["--shapes", "tiny", "--device", "cpu", "--batch", "2", "--streams", "2", "--frames", "3",
                   "--warmup", "1", "--rest-slots", "2", "--rest-requests", "2", "--rest-seconds", "1"],
        [r"duplex frame at B=2 \(ms\)", r"paired transcription, in frame\s+\d+\.\d\d",
         r"standalone STT step \(ms\)\s+streams", r"^\s+2\s+\d+\.\d\d\s+\d+\.\d\d",
         r"/v1/audio/transcriptions rows \(2 slots, 2 x 1 s.*\d+\.\d audio seconds per wall second"]),
    "diffusion_interference": (
        "diffusion_interference.py", ["--smoke", "--loads", "0,1", "--batches", "1", "--sizes", "16",
                                      "--steps", "3", "--seconds", "1"],
        [r"\| B \| K \| px \| late p50/p99/max ms.*\| steps/s \(% bare x4\) \| steps % queue alone \| "
         r"img/min \(% queue alone\)", r"\| 1 \| 0 \| - \|",
         r"\| 1 \| 1 \| 16 \| .* \| \d+\.\d \(\d+ %\) \| (\d+ %|-) \| \d+\.\d \((\d+ %|-)\) \|",  # -: alone made none
         r"bare denoise steps/s \(batch \d+, back to back\): \{16: \d+\.\d\}",
         r"queue alone K=1 16 px \(no voice, 1 s\): \d+\.\d steps/s, \d+\.\d img/min"]),
    "image_step": (  # every variant, a whole and a tiled size
        "image_step.py", ["--smoke", "--sizes", "16,40", "--batches", "1,2", "--replays", "1", "--warmup", "0"],
        [r"\| variant \| px \| step b1 ms \| step b2 ms \| decode ms \| preview ms \| weights MiB \|",
         r"^\| plain \| 16 \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d \|$",
         *(rf"^\| {v} \| {px} \| \d+\.\d\d \([+-]\d+\.\d %\) \|.* \| \d+\.\d \|$"
           for v in ("channels_last", "fused_qkv", "both") for px in ("16", "40\\*")),
         r"^\* decode: tile by tile"]),
    "kv_drift": (
        "kv_drift.py", ["--tiny", "--batch", "2", "--frames", "4", "--prefix", "50"],
        [r"4 frames after a 50-frame prefix, B=2: max \|text-logit diff\| \d\.\d{4} .*greedy text agreement "
         r"\d+\.\d %"]),
    "image_queue_replay": (
        "image_queue_replay.py", ["--loads", "1,2", "--ticks", "40"],
        [r"\| K \| steps/s \(% of standalone\) \| images/min", r"\| 1 \| \d+\.\d \(\d+ % of \d+\)",
         r"\| 2 \| \d+\.\d \(\d+ % of \d+\)"]),
    "load": (  # both doors on one server, side by side: /api/chat, then GPT-Live
        "load.py", ["--spawn", "tiny", "--clients", "2", "--duration", "2", "--doors", "chat,live"],
        [r"^door\s+chat\s+live$", r"^clients\s+2\s+2$", r"^served\s+2\s+2$",
         r"^jitter_p99_ms\s+\d+\.\d\d\s+\d+\.\d\d$", r"^frames_lost\s+\d+\s+\d+$", r"^late_ticks\s+\d"]),
    "load_webrtc": (  # GPT-Live over WebRTC, the clients in 2 processes (the H200's 64-call run, small)
        "load.py", ["--spawn", "tiny", "--clients", "2", "--procs", "2", "--duration", "2", "--doors", "webrtc"],
        [r"^door\s+webrtc$", r"^served\s+2$", r"^frames_sent\s+[1-9]\d*$", r"^jitter_p99_ms\s+\d+\.\d\d$",
         r"^frames_lost\s+\d+$", r"^late_ticks\s+\d", r"^webrtc_workers_cpu_cores\s+\d+\.\d\d$"]),
    "gil_tick": (  # the engine's tick beside a busy loop, at both switch intervals (1 s each)
        "gil_tick.py", ["--sessions", "8", "--seconds", "1", "--frame-ms", "5"],
        [r"^\| switch interval \| ticks \| tick p50 ms", r"^\| 5 ms \| \d+ \| \d+\.\d \| \d+\.\d \| \d+ \| ",
         r"^\| 0\.5 ms \| \d+ \| \d+\.\d \| \d+\.\d \| \d+ \| "]),
    "row_copies": (
        "row_copies.py", ["--rows", "8", "--stt-rows", "4", "--repeats", "2"],
        [r"^\| work \| alone ms \| beside a busy thread ms \|$", r"^\| plan, 8 rows \| \d+\.\d\d \| \d+\.\d\d \|$",
         r"^\| route, 8 rows, a numpy copy per row \| ", r"^\| STT input, 4 rows, numpy copies per row \| "]),
    "capacity": (  # 2 minutes of traffic at time scale 0.02: ~2.4 s of arrivals, periods of 1.2 s
        "capacity.py", ["--spawn", "tiny", "--target", "2", "--minutes", "2", "--time-scale", "0.02"],
        [r"sigma 0\.541 \(10 % past 240 s, mean 139 s\)",
         r"^server: model ckpt, 3 sessions at most, Mimi: duplex float32$",  # the codec auto chose, on record
         r"^\| minute \(traffic time\) \| arrived \| refused \|.* \| loop CPU, cores \| engine CPU, cores \| edge CPU per "
         r"session, ms/s \| engine process CPU, ms per tick \| tick ms: plan/rows/launch/device/route \| held \|$",
         r"^\| 0 \| \d+ \| \d+ \| \d+ \| \d+\.\d \| \d+\.\d\d \| \d+ \| \d+ \| \d+ \| \d+\.\d\d \| \d+\.\d\d \| - \| - \| "
         r"\d+\.\d/\d+\.\d/\d+\.\d/\d+\.\d/\d+\.\d \| (yes|no) \|$",
         r"^most concurrent sessions held \(frame p99 <= 60 ms, 0 late ticks, 0 frames lost\): \d+$",
         r"^the server's refusals by reason \(docs/protocols.md\): (none|[a-z_]+ \d+(, [a-z_]+ \d+)*)$",
         r"^minute 0 done: live max \d+, frame p99 \d+\.\d ms, \d+\.\d\d % of frames over 60 ms, late \d+, "
         r"engine drops \d+, KV blocks \d+, loop / engine cores \d+\.\d\d / \d+\.\d\d, edge CPU per session - ms/s, "
         r"engine process CPU - ms per tick, tick ms "]),
    "transcript_delay": (
        "transcript_delay.py", ["--spawn", "tiny", "--paired", "1", "--standalone", "1", "--duration", "2"],
        [r"path\s+deltas\s+mean ms\s+p50 ms", r"^paired\s+\d+", r"^standalone\s+\d+",
         r"during the run: late_ticks \d+"]),
    "soak": (  # 6 s: the paced sessions, samples and summary; the attacks need runs of a minute or more
        "soak.py", ["--spawn", "tiny", "--sessions", "2", "--minutes", "0.1", "--procs", "1"],
        [r"sessions 2 \(0 refused, 1 client processes\)", r"frames lost per session: mean \d+\.\d",
         r"late ticks \d+, skipped \d+", r"RSS: "]),
    "mixed_soak": (  # ~20 s of every kind at once on the demo server (the server's start takes longer)
        "mixed_soak.py", ["--minutes", "0.3", "--sample", "5", "--chat-sessions", "1",
                          "--periods", "chat=5,image=4,realtime=6,live=6"],
        [r"^\| minute \| RSS MB \| chat ok/err \| speech ok/err \| transcription ok/err \| image ok/err \| "
         r"realtime ok/err \| live ok/err \|$", r"^\| 0\.\d\d \| \d+\.\d \|( \d+/\d+ \|){6}$",
         r"^requests chat \d+ \(\d+ errors, \d+ cut at the end\), speech \d+ \(\d+ errors, .* live \d+ \(\d+ errors, "
         r"\d+ cut at the end\)$",
         r"^RSS: \d+\.\d -> \d+\.\d MB .*fitted slope [+-]\d+\.\d\d MB/min"]),
    "mixed_soak_in_process": (  # the server on a thread: tracemalloc's total sampled, its growth by line
        "mixed_soak.py", ["--in-process", "--minutes", "0.2", "--sample", "4", "--kinds", "transcription,realtime",
                          "--periods", "realtime=4"],
        [r"^\| minute \| RSS MB \| traced MB \| transcription ok/err \| realtime ok/err \|$",
         r"^traced growth since the first sample, top 12 lines:$", r"^\s+[+-]\d+\.\d KiB\s+[+-]\d+ blocks  \S+:\d+$",
         r"^traced: \d+\.\d -> \d+\.\d MB"]),
    "mixed_soak_trace": (  # --trace: in process, tracemalloc snapshots around 1 + 1 requests of two kinds
        "mixed_soak.py", ["--trace", "1", "--kinds", "transcription,realtime", "--top", "3"],
        [r"^transcription: 1 requests [+-]\d+\.\d KiB, 1 more [+-]\d+\.\d KiB \(traced, after gc\); \d+ of 3",
         r"^realtime: 1 requests [+-]\d+\.\d KiB"]),
    "mixed_load": (  # each kind alone, then together, on the demo server (every modality, tiny)
        "mixed_load.py", ["--duration", "3", "--duplex", "1", "--tts", "1", "--transcription", "1", "--images", "1",
                          "--image-steps", "2"],
        [r"^\| kind \| figure \| alone \| together \|$", r"^\| duplex \| frames lost \| \d+ \| \d+ \|$",
         r"^\| tts \| first audio p50 ms \| ", r"^\| transcription \| delay p99 ms \| ",
         r"^\| image \| images/min \| \d+\.\d \| \d+\.\d \|$",
         r"^late ticks: duplex alone \d+, tts alone \d+, transcription alone \d+, image alone \d+, together \d+$"]),
    "kyutai_load": (  # Kyutai's doors on the demo server: ASR and TTS streams beside a duplex session
        "kyutai_load.py", ["--asr", "2", "--tts", "1", "--duplex", "1", "--duration", "3"],
        [r"^\| kind \| figure \| value \|$", r"^\| asr \| served \| 2 \|$", r"^\| asr \| refused \| 0 \|$",
         r"^\| asr \| held in real time \(<= 500 ms\) \| \d+ \|$", r"^\| asr \| step delay p99 ms \| \d+\.\d \|$",
         r"^\| asr \| server transcript delay p99 ms \| ", r"^\| tts \| requests done \| [1-9]\d* \|$",
         r"^\| tts \| first audio p50 ms \| \d+\.\d \|$", r"^\| duplex \| sessions \| 1 \|$",
         r"^\| engine \| late ticks \| \d+\.\d \|$"]),
    "paged_attention": (  # "ours only" (FlashInfer is a GPU comparison): tiny shapes in Triton's interpreter
        "paged_attention.py", ["--device", "cpu", "--launches", "default,16x4x1x4"],
        [r"^launch: default$", r"^launch: 16x4x1x4$", r"^\| B \| KV \| block \| ours dense ms \| ours paged ms \|",
         r"^\| 2 \| bf16 \| \d+ \| \d+\.\d{3} \| \d+\.\d{3} \| \d+\.\d\d \|",
         r"^\| 2 \| fp8 \| \d+ \| \d+\.\d{3} \| \d+\.\d{3} \|"]),
    "mimi_quality": (  # the tiny Mimi on the CPU: no TF32 there, so the float32 row is exact
        "mimi_quality.py", ["--device", "cpu", "--tiny", "--batch", "2", "--frames", "6"],
        [r"^\| variant \| semantic codes equal \| all codes equal \| decode SNR vs exact reference \|$",
         r"^\| parley float32, TF32 off \| 100\.00% \| 100\.00% \| exact \|$",
         r"^\| parley bfloat16 \| \d+\.\d\d% \| \d+\.\d\d% \| (\d+\.\d dB|exact) \|$"]),
    "frame_latency_hibiki": (  # the Hibiki-Zero frame (paged KV) beside the reference's B = 1, at tiny shapes
        "frame_latency.py", ["--shapes", "tiny-hibiki-zero", "--device", "cpu", "--batches", "1,2", "--frames", "2",
                             "--warmup", "1", "--windows", "full", "--reference-batches", "1", "--kv-blocks", "fit"],
        [r"weights: tiny-hibiki-zero shapes, random float32  Parley KV cache: bf16, paged fit, read by the general path",
         r"^Parley attention: temporal: general path \(no CUDA Triton kernels here\); depformer: general path",
         r"^Conditioning: description very_good \(both sides\), cfg_coef 1$",
         r"^\| 1 \| full \| \d+\.\d\d \| \d+\.\d\d \| .* \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d\dx \|",
         r"^\| 2 \| full \| \d+\.\d\d \| \d+\.\d\d \| .* \| - \|  \|  \|",  # no reference at B = 2
         r"^  B=2 full: Parley p50 \d+\.\d\d ms = \d+\.\d\dx the reference's one-session frame, for 2 sessions$"]),
    "cli_startup": (
        "cli_startup.py", ["--runs", "1"],
        [r"^\| command \| median \(s\) \| slowest \(s\) \| heavy imports \|$",
         r"^\| parley serve --help \| \d+\.\d\d \| \d+\.\d\d \| none \|$",
         r"^\| parley --version \| \d+\.\d\d \| \d+\.\d\d \| none \|$"]),
}

# s (the others: 120): the demo server's start, then a drain, on a loaded box
# the reference package each compares against (tests/run.sh installs it)
CPU_NEEDS = {"mimi_quality": "moshi", "frame_latency_hibiki": "moshi"}
CPU_TIMEOUTS = {"frame_latency_hibiki": 240, "kyutai_load": 240, "mixed_load": 240, "mixed_soak": 240,
                "mixed_soak_in_process": 240, "mixed_soak_trace": 240}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_benchmark_runs_on_cpu(case: str) -> None:
    script, args, patterns = CPU_CASES[case]
    if case in CPU_NEEDS:
        pytest.importorskip(CPU_NEEDS[case])
    output = run_benchmark(script, *args, timeout=CPU_TIMEOUTS.get(case, 120))
    for pattern in patterns:
        assert re.search(pattern, output, re.MULTILINE), f"{script}: no /{pattern}/ in:\n{output[-4000:]}"


def test_load_refuses_server_options_without_a_server_to_start() -> None:
    """--serve-log / --serve-arg shape the server --spawn starts; with --url they would be ignored."""
    for option in ("--serve-log=/tmp/x.log", "--serve-arg=--kv-dtype=fp8"):
        proc = subprocess.run([sys.executable, str(BENCH / "load.py"), "--url", "ws://127.0.0.1:9", option],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "apply to a server this script starts" in proc.stderr, proc.stderr


def test_write_models_tiny_served_by_mixed_load(tmp_path: Path) -> None:
    """The H200 chain at tiny shapes on the CPU: write_models.py writes every kind in its layout,
    mixed_load.py --models serves them all through one `parley serve`, and each kind alone gives
    output (frames back, audio, transcript deltas, images), then all of them together."""
    written = run_benchmark("write_models.py", "--dir", str(tmp_path), "--shapes", "tiny", "--device", "cpu")
    for kind in ("duplex", "tts", "stt", "image"):
        assert re.search(rf"^{kind}: {tmp_path / kind} \d+\.\d\d GB, written in", written, re.MULTILINE), written
    output = run_benchmark("mixed_load.py", "--models", str(tmp_path), "--duration", "3", "--duplex", "1", "--tts", "1",
                           "--transcription", "1", "--images", "1", "--image-steps", "2", "--serve-arg=--device=cpu",
                           timeout=240)
    alone = {m[1]: json.loads(m[2])[m[1]] for m in re.finditer(r"^(\w+) alone: (.*)$", output, re.MULTILINE)}
    assert alone["duplex"]["sessions"] == 1 and alone["duplex"]["frames back"] > 0, output[-4000:]
    assert alone["tts"]["requests"] > 0 and alone["tts"]["errors"] == 0, output[-4000:]
    assert alone["transcription"]["deltas"] > 0, output[-4000:]
    assert alone["image"]["images"] > 0 and alone["image"]["errors"] == 0, output[-4000:]
    together = json.loads(re.search(r"^together: (.*)$", output, re.MULTILINE)[1])
    assert together["duplex"]["frames back"] > 0 and set(together) >= set(alone), output[-4000:]


def test_write_models_real_shapes_load_on_meta(tmp_path: Path) -> None:
    """The real-shape TTS (1.6B) and STT (1B) layouts, weights as sparse zeros (no memory, no disk),
    read back by the loaders `parley serve` uses, on the meta device: config.json, file names, every
    key and shape, the tokenizer, the voices and the voice map (a tensor at a time, none kept)."""
    output = run_benchmark("write_models.py", "--dir", str(tmp_path), "--device", "meta", "--kinds", "tts,stt",
                           "--check")
    assert re.search(r"^tts: loaded on meta: 1,8\d\d\.\d M LM parameters, n_q 32, 17 voice names", output,
                     re.MULTILINE), output
    assert re.search(r"^stt: loaded on meta: 9\d\d\.\d M LM parameters, n_q 32", output, re.MULTILINE), output
    assert (tmp_path / "tts" / "dsm_tts_1e68beda@240.safetensors").stat().st_size > 3e9  # bf16 1.8 B, sparse


def test_mixed_load_keeps_the_together_phases_tick_trace(tmp_path: Path) -> None:
    """--tick-trace: the demo server traces its ticks; the together phase's are kept (with the header) and
    benchmarks/tick_timeline.py's table printed; the server's whole trace is removed."""
    trace = tmp_path / "together.jsonl"
    output = run_benchmark("mixed_load.py", "--duration", "2", "--duplex", "1", "--tts", "1", "--transcription", "0",
                           "--images", "0", "--tick-trace", str(trace), timeout=240)
    kept = int(re.search(rf"^tick trace: (\d+) ticks of the together phase in {re.escape(str(trace))}$", output,
                         re.MULTILINE)[1])
    header, *ticks = [json.loads(line) for line in trace.read_text().splitlines()]
    assert header["trace"] == "parley tick timeline" and header["gpu"] is False and len(ticks) == kept > 0
    assert any(phase[0] == "launch" for tick in ticks for phase in tick["phases"]), "no frame in the together phase"
    assert re.search(r"^\d+ ticks \(\d+ with a frame\), period 80 ms, device times: no$", output, re.MULTILINE)
    assert re.search(r"^\| host: launch \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d % \|$", output, re.MULTILINE), output
    assert not (tmp_path / "together.jsonl.all").exists()


def test_mixed_loads_gpu_busy_is_the_mean_of_the_readings_over_the_phase(monkeypatch, capsys) -> None:
    """--gpu-busy's sampler reads on its own thread from start to stop (at least once, even when the phase
    is shorter than a period) and gives their mean; a machine NVML cannot read is an argument error."""
    import itertools
    import threading

    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module("mixed_load")
    values, read, third = itertools.cycle([10.0, 20.0, 60.0, 90.0]), [], threading.Event()

    def reading() -> float:
        read.append(next(values))
        if len(read) == 3:
            third.set()
        return read[-1]

    busy = module.GpuBusy(reading, period=0.0)
    busy.start()
    assert third.wait(30)
    assert busy.stop() == sum(read) / len(read) and len(read) >= 3
    busy = module.GpuBusy(lambda: 55.0, period=3600.0)  # stopped before its second reading
    busy.start()
    assert busy.stop() == 55.0
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as on a machine without nvidia-ml-py
    with pytest.raises(SystemExit) as exit_:
        module.main(["--gpu-busy", "1"])
    assert exit_.value.code == 2
    assert "--gpu-busy 1: NVML cannot read that GPU (ModuleNotFoundError" in capsys.readouterr().err


# Scripts with a test of their own (above, or tests/test_tick_timeline.py; each writes in a directory of the test's).
OWN_TESTS = ("write_models.py", "tick_timeline.py", "offline_site.py")

# Scripts only imported here: those whose every path needs CUDA (run small under `gpu` below),
# and CPU ones too slow for this file (attacks.py, edge_cpu.py: a server per run and seconds per
# attack or session; plot_frames.py draws a GPU run's JSON). Their module level (imports, shared
# helpers, the benchmarks-folder imports) still runs here.
IMPORT_ONLY = ("profile_frame.py", "load_7b.py", "seeded_sampling.py", "attention_kernel.py",
               "attacks.py", "edge_cpu.py", "plot_frames.py", "profile_tts.py", "fp8_attention_variants.py",
               "mimi_steps.py", "frame_gpu_time.py", "flashinfer_decode.py", "fp8_weights.py")


def undefined_globals(path: Path) -> list[str]:
    """`function:line name` for each name a function of `path` reads as a global that the module
    never binds (nor builtins hold): a NameError waiting for that line to run."""
    top = symtable.symtable(path.read_text(), str(path), "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    known = bound | set(dir(builtins)) | {"__file__", "__name__"}
    found, tables = [], list(top.get_children())
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        if table.get_type() == "function":
            found += [f"{table.get_name()}:{table.get_lineno()} {s.get_name()}" for s in table.get_symbols()
                      if s.is_global() and s.is_referenced() and s.get_name() not in known]
    return sorted(found)


def test_benchmarks_read_no_unbound_names() -> None:
    """Every script's functions, the CUDA-only ones included, read only names their module binds:
    profile_tts.py once read a `graphs` dict that a refactor had removed, and only a GPU run found it."""
    found = {p.name: undefined_globals(p) for p in sorted(BENCH.glob("*.py"))}
    assert not {name: names for name, names in found.items() if names}


def test_the_unbound_name_check_finds_one(tmp_path) -> None:
    script = tmp_path / "bench.py"
    script.write_text("import torch\n\ndef run(n):\n    return torch.zeros(n) + graphs[n]\n")
    assert undefined_globals(script) == ["run:3 graphs"]


def test_other_benchmarks_import() -> None:
    optional = {"attention_kernel.py": "triton", "fp8_attention_variants.py": "triton",  # CUDA-only
                "plot_frames.py": "matplotlib"}  # the bench extra
    scripts = [s for s in IMPORT_ONLY if s not in optional or importlib.util.find_spec(optional[s])]
    code = ("import runpy, sys\n"
            "for path in sys.argv[1:]:\n"
            "    runpy.run_path(path, run_name='benchmark_import_check')\n"
            "    print('imported', path)\n")
    proc = subprocess.run([sys.executable, "-c", code, *(str(BENCH / s) for s in scripts)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("imported") == len(scripts), proc.stdout


def test_every_benchmark_is_covered() -> None:
    """A new benchmark script must be added here (run on CPU, or imported and run under `gpu`)."""
    covered = {script for script, _, _ in CPU_CASES.values()} | set(IMPORT_ONLY) | set(OWN_TESTS)
    # helper modules: frame_setup (shapes and checkpoints), tts_clients (tts_load's HTTP client process),
    # stall_watch (tts_load's --watch-stalls; tested below), webrtc_load (load.py's WebRTC clients; the
    # load_webrtc case runs them)
    scripts = {p.name for p in BENCH.glob("*.py")} - {"frame_setup.py", "tts_clients.py", "stall_watch.py",
                                                      "webrtc_load.py"}
    assert scripts <= covered, f"benchmarks not smoke-tested: {sorted(scripts - covered)}"


def test_stall_watch_names_what_held_the_gil(monkeypatch) -> None:
    """tts_load --watch-stalls: a C call that holds the GIL for ~0.1 s or more (sorting a big
    shuffled list) is a stall at least that long, and its stacks name the function that made it
    (other threads left by earlier tests may stall it too: only the stalls during the sort count)."""
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module("stall_watch")
    data = list(range(400_000))
    random.Random(0).shuffle(data)
    watch = module.StallWatch(0.03).start()
    try:
        time.sleep(0.05)  # the watchdog is running
        t0 = time.perf_counter()
        sorted(data)  # in C, GIL held throughout
        sort_s = time.perf_counter() - t0
        time.sleep(0.05)
    finally:
        watch.stop()
    assert sort_s >= 0.05, f"the sort took {sort_s:.3f} s: too short to test a 30 ms threshold"
    stalls = [s for s in watch.stalls_since(t0) if s.start <= t0 + sort_s]
    assert stalls and max(s.seconds for s in stalls) >= 0.03
    text = "\n".join(s.describe(t0) for s in stalls)
    assert "test_stall_watch_names_what_held_the_gil" in text, text


# Small GPU runs of the CUDA-only paths: the first thing to run in a GPU session.
GPU_CASES = {
    "frame_latency": ("frame_latency.py", ["--batches", "1", "--frames", "2", "--warmup", "1", "--windows", "empty"],
                      [r"\| B \| window \| Parley p50", r"\| 1 \| empty \| \d+\.\d\d"]),
    "frame_latency_hibiki": ("frame_latency.py", ["--shapes", "hibiki-zero-3b", "--batches", "1,2", "--frames", "2",
                                                  "--warmup", "1", "--windows", "full", "--reference-batches", "1",
                                                  "--kv-dtype", "fp8", "--kv-blocks", "fit"],
                             [r"weights: Hibiki-Zero 3B shapes, random bfloat16",
                              r"^Parley attention: temporal: fused Triton decode kernels; depformer: fused Triton",
                              r"^\| 1 \| full \| \d+\.\d\d .* \| \d+\.\d\dx \|", r"^  B=2 full: Parley p50"]),
    "profile_frame": ("profile_frame.py", ["--batch", "1", "--frames", "2", "--warmup", "1"], [r"GPU: "]),
    "profile_tts": ("profile_tts.py", ["--rows", "2", "--replays", "2", "--warmup", "1"],
                    [r"rows 2: text \d+\.\d\d ms, full \d+\.\d\d ms", r"weight matmuls\s+\d+\.\d\d ms"]),
    "fp8_attention_variants": ("fp8_attention_variants.py", ["--batches", "2", "--windows", "full"],
                               [r"B=2 full\s+fp16\s+128x3x4: \d+\.\d+ ms .* rel\. error \d\.\de-\d\d",
                                r"B=2 full\s+split_d .* registers"]),
    "mimi_steps": ("mimi_steps.py", ["--batches", "2", "--frames", "2"],
                   [r"^\| 2 \| plain \| \d+\.\d{3} \| \d+ \|", r"^\| 2 \| bfloat16 \| .* dB \|$"]),
    "fp8_weights": ("fp8_weights.py", ["--batches", "2", "--layers", "1", "--replays", "2"],
                    [r"^\| 2 \| bf16 \| \d+\.\d\d \| .* \| 0\.00% \|$", r"^\| 2 \| fp8 tensor \| .* \| \d\.\d\d% \|$"]),
    "kv_drift": ("kv_drift.py", ["--batch", "1", "--frames", "2"], [r"greedy text agreement \d+\.\d %"]),
    "frame_gpu_time": ("frame_gpu_time.py", ["--batch", "1", "--frames", "3", "--warmup", "1"],
                       [r"gc as is: wall p50 \d+\.\d\d .* gpu p50 \d+\.\d\d", r"gc frozen: wall p50"]),
    "seeded_sampling": ("seeded_sampling.py", ["--batch", "2"], [r"GPU .*batch 2"]),
    "image_step": ("image_step.py", ["--variants", "plain,both", "--replays", "2", "--warmup", "1"],
                   [r"^\| both \| 512 \| \d+\.\d\d \([+-]\d+\.\d %\) \|"]),
    "tts_load_duplex_7b": ("tts_load.py", ["--shapes", "tiny", "--duplex", "7b", "--streams", "1", "--sessions", "1",
                                           "--device", "cuda", "--settle", "0.5", "--idle-seconds", "0.5",
                                           "--text", "Good morning."],
                           [r"duplex backend 7b", r"\| http \| 1 \| 1 \| \d+ / \d+ \|"]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_benchmark_runs_on_gpu(case: str) -> None:
    script, args, patterns = GPU_CASES[case]
    output = run_benchmark(script, *args, timeout=600)
    for pattern in patterns:
        assert re.search(pattern, output, re.MULTILINE), f"{script}: no /{pattern}/ in:\n{output[-4000:]}"
