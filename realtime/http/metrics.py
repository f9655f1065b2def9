"""`/metrics` (the probes and `/load` are in sessions/capacity.py).

- `/metrics`: Prometheus text. The engine's counters and histograms (read from
  `engine.counters()` at scrape time), plus the edge's own: connections, refusals, live
  sessions, bytes in and out per protocol, and the per-frame send delay. Labels are
  protocol names, door paths and fixed reason codes only, never session ids or client
  addresses (their cardinality is unbounded).
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import Response

from ..engine_client import FULL_COLLECTIONS, SLACK_COLLECTIONS, TICK_PHASES
from ..sessions.refusals import Refusals
from ..server.workers import thread_cpu_seconds
from ..server.state import app_state

# Frame send delay buckets (seconds): a frame is due every 80 ms, so anything near that
# means a client hears a gap.
FRAME_DELAY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
# End-to-end frame delay (engine tick end -> socket write): normally a few ms; past 80 ms the
# edge is a frame behind.
E2E_DELAY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
# Transcript delay (input frame arrival -> delta written), on top of the model's text delay: a
# frame waits up to a tick to be read, then its step; the target is under 100 ms.
TRANSCRIPT_DELAY_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.16, 0.24, 0.32, 0.64, 1.28, 2.56)

# engine.counters() keys exposed as counters; the rest are gauges or histograms.
ENGINE_COUNTERS = ("ticks", "late_ticks", "skipped_ticks", "underruns", "overruns",
                   "dropped_events", "sessions_opened", "sessions_failed",
                   # the slack runner (engine/slack.py): items after each tick, and the ones that
                   # overran their estimate or ended past the next boundary
                   "slack_items", "slack_seconds", "slack_overruns", "slack_past_boundary", "slack_failed",
                   "slack_stale_drops", "slack_stale_trials",
                   # the TTS pool (engine/tts_pool.py), when one is loaded
                   "tts_steps_text", "tts_steps_full", "tts_frames", "tts_starved", "tts_forced",
                   "tts_completed", "tts_cancelled", "tts_failed",
                   # standalone transcription rows (engine/stt_pool.py), when an STT model is loaded
                   "stt_requests", "stt_steps", "stt_audio_seconds", "stt_completed", "stt_cancelled",
                   "stt_failed", "stt_starved",
                   # paired transcription (engine/stt_paired.py)
                   "stt_paired_steps", "stt_paired_rows_stepped", "stt_paired_dropped",
                   # the KV block pool (engine/kv_blocks.py): blocks the shrink policy took from a
                   # row, and rows that found the pool empty under reserve (never, unless a bug)
                   "kv_shrinks", "kv_shortfalls",
                   # seconds the ticks spent planning, changing rows, launching the step, waiting for the
                   # device, routing (the engine's tick phases)
                   *(f"tick_{phase}_seconds" for phase in TICK_PHASES))
ENGINE_GAUGES = ("live_slots", "free_slots", "healthy", "tts_live", "tts_slots", "stt_live", "stt_slots",
                 "stt_queued", "stt_paired_live", "stt_paired_slots",
                 # the STT models' own text delay (frames / frame rate): transcript delay comes on top
                 "stt_model_delay_seconds", "stt_paired_model_delay_seconds",
                 # the KV block pool: blocks in the pool, held by rows, free, the most ever held, promised
                 # to admitted sessions, and how many more sessions memory admits now
                 "kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "kv_blocks_high_water",
                 "kv_blocks_promised", "kv_sessions_admittable")
ENGINE_HISTOGRAMS = ("tick_seconds", "prefill_seconds", "tick_start_lag_seconds")


class EngineCollector:
    """Reads the engine's snapshot at scrape time (no background polling)."""

    def __init__(self, counters: Callable[[], dict]) -> None:
        self._counters = counters

    def collect(self) -> Iterable:
        snap = self._counters()
        for name in ENGINE_COUNTERS:
            if name in snap:
                family = CounterMetricFamily(f"parley_engine_{name}", f"engine counter: {name}")
                family.add_metric([], float(snap[name]))
                yield family
        for name in ENGINE_GAUGES:
            if name in snap:
                family = GaugeMetricFamily(f"parley_engine_{name}", f"engine gauge: {name}")
                family.add_metric([], float(snap[name]))
                yield family
        for name in ENGINE_HISTOGRAMS:
            hist = snap.get(name)
            if not hist:
                continue
            family = HistogramMetricFamily(f"parley_engine_{name}", f"engine histogram: {name}")
            family.add_metric([], buckets=[(bound, float(count)) for bound, count in hist["buckets"].items()],
                              sum_value=float(hist["sum"]))
            yield family


class _WorkerCPUCollector:
    """CPU seconds of worker processes (process_cpu_seconds_total covers only the server process):
    read at scrape time. Live workers only, so it can step down after a restart."""

    def __init__(self, name: str, what: str, seconds: Callable[[], float]) -> None:
        self._name = name
        self._what = what
        self._seconds = seconds

    def collect(self) -> Iterable:
        family = GaugeMetricFamily(self._name, f"CPU seconds used by the live {self._what} worker processes")
        family.add_metric([], float(self._seconds()))
        yield family


class _ThreadCPUCollector:
    """CPU seconds of the server's event loop and engine threads, read at scrape time (Linux /proc).
    They share one GIL, so their sum near one core means a tick waits for the loop's Python."""

    def __init__(self, threads: Callable[[], dict[str, int | None]]) -> None:
        self._threads = threads

    def collect(self) -> Iterable:
        family = CounterMetricFamily("parley_thread_cpu_seconds", "CPU seconds of the server process's event "
                                     "loop and engine threads, which share one GIL", labels=["thread"])
        for name, tid in self._threads().items():
            if tid is not None:
                family.add_metric([name], thread_cpu_seconds(tid))
        yield family


class _FullCollectionsCollector:
    """Python's full garbage collections since the server froze its loaded objects
    (engine/gc_pauses.py): each one stalls every thread, the engine's included."""

    def collect(self) -> Iterable:
        snap = FULL_COLLECTIONS.snapshot()
        count = CounterMetricFamily("parley_gc_full_collections", "full (generation 2) garbage collections")
        count.add_metric([], float(snap["gc_full_collections"]))
        pause = CounterMetricFamily("parley_gc_full_pause_seconds", "time spent in full garbage collections")
        pause.add_metric([], snap["gc_full_seconds"])
        longest = GaugeMetricFamily("parley_gc_full_pause_max_seconds", "the longest full garbage collection")
        longest.add_metric([], snap["gc_full_max_seconds"])
        forced = CounterMetricFamily("parley_gc_full_forced", "full garbage collections the engine ran without "
                                     "a slack that could hold them (a minute had none)")
        forced.add_metric([], float(SLACK_COLLECTIONS.forced))
        yield from (count, pause, longest, forced)


def exposition(families: Iterable[Metric], process: str) -> bytes:
    """`families` as exposition text, every sample labelled by the process it came from
    (`process="engine"`, `"edge-0"`): how one process's metrics travel to the others' scrapes as
    bytes, forwarded as they are (rendered once a second, parsed only when a scrape asks)."""
    out = []
    for family in families:
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [sample._replace(labels={**sample.labels, "process": process}) for sample in family.samples]
        out.append(copy)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(out))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def parsed(texts: Iterable[bytes]) -> list[Metric]:
    """The families of other processes' `exposition` texts."""
    return [family for text in texts for family in text_string_to_metric_families(text.decode())]


class _Merged:
    """One scrape of several processes, shaped as one process's scrape: the families of each, their
    samples (told apart by `process` on the way) combined into the series a one-process server shows,
    so dashboards and alerts read the same names either way. Counters and histograms add up; gauges
    add up (sessions, bytes) except maxima (`_max_`) and start times, which take the largest and the
    earliest. `parley_process_cpu_seconds_total{process}` keeps each process's own CPU."""

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        joined: dict[str, Metric] = {}
        values: dict[str, dict[tuple, float]] = {}
        per_process = CounterMetricFamily("parley_process_cpu_seconds", "CPU seconds of each of the server's processes",
                                          labels=["process"])
        for family in self._families():
            if family.name not in joined:
                joined[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            combine = _combiner(family)
            series = values[family.name]
            for sample in family.samples:
                if sample.name == "process_cpu_seconds_total":
                    per_process.add_metric([sample.labels.get("process", "")], sample.value)
                labels = tuple((k, v) for k, v in sample.labels.items() if k != "process")  # in their order
                key = (sample.name, labels)
                series[key] = sample.value if key not in series else combine(series[key], sample.value)
        for name, family in joined.items():
            for (sample_name, labels), value in values[name].items():
                family.add_sample(sample_name, dict(labels), value)
            yield family
        if per_process.samples:
            yield per_process


def _combiner(family: Metric) -> Callable[[float, float], float]:
    """How two processes' values of one series make the scrape's (`_Merged`)."""
    if family.type in ("counter", "histogram", "summary"):
        return lambda a, b: a + b
    if family.type == "gauge":
        if family.name.endswith("start_time_seconds"):
            return min
        return max if "_max_" in family.name else (lambda a, b: a + b)
    return lambda a, b: a  # info, stateset: each process says the same


def _process_collectors(r: CollectorRegistry, threads: Callable[[], dict[str, int | None]] | None,
                        engine_counters: Callable[[], dict] | None) -> None:
    """What every process's registry shows of itself: process_cpu_seconds_total etc. (benchmarks/load.py
    reads CPU there), parley_thread_cpu_seconds_total{thread} (benchmarks/capacity.py), full garbage
    collections, and the engine's counters where it has them."""
    ProcessCollector(registry=r)
    if threads is not None:
        r.register(_ThreadCPUCollector(threads))
    r.register(_FullCollectionsCollector())
    if engine_counters is not None:
        r.register(EngineCollector(engine_counters))


def engine_registry(engine_counters: Callable[[], dict], engine_thread: Callable[[], int | None],
                    collectors: Iterable = ()) -> CollectorRegistry:
    """The engine process's metrics (server/engine_core.py): its counters, its modalities' collectors,
    its own CPU, engine thread and garbage collections. Edge workers show them on their /metrics."""
    r = CollectorRegistry(auto_describe=True)
    _process_collectors(r, lambda: {"engine": engine_thread()}, engine_counters)
    for collector in collectors:
        r.register(collector)
    return r


class EdgeMetrics:
    """The network edge's metrics, in a registry of its own (one per app)."""

    def __init__(self, engine_counters: Callable[[], dict] | None = None,
                 codec_cpu_seconds: Callable[[], float] | None = None,
                 webrtc_cpu_seconds: Callable[[], float] | None = None,
                 threads: Callable[[], dict[str, int | None]] | None = None,
                 process: str | None = None, others: Callable[[], Iterable[bytes]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.connections = Counter("parley_connections", "WebSocket connections accepted", ["protocol"], registry=r)
        self.refused = Counter("parley_sessions_refused", "accepted connections closed 1013 because every slot "
                               "was taken (upgrades refused with 503: parley_admission_rejected_total)",
                               ["protocol"], registry=r)
        self.live_sessions = Gauge("parley_live_sessions", "connections being served now", ["protocol"], registry=r)
        self.bytes_in = Counter("parley_bytes_in", "payload bytes received from clients", ["protocol"], registry=r)
        self.bytes_out = Counter("parley_bytes_out", "payload bytes sent to clients", ["protocol"], registry=r)
        self.frames_out = Counter("parley_frames_out", "80 ms output frames sent", ["protocol"], registry=r)
        self.frame_send_delay = Histogram(
            "parley_frame_send_delay_seconds",
            "from an output frame reaching the event loop to its bytes being written to the socket",
            buckets=FRAME_DELAY_BUCKETS, registry=r)
        self.frame_delay = Histogram(
            "parley_frame_delay_seconds",
            "end-to-end output frame delay: from the end of the engine tick that produced a frame to its "
            "bytes being written to the socket (codec and queueing included)",
            buckets=E2E_DELAY_BUCKETS, registry=r)
        self.transcript_delay = Histogram(
            "parley_transcript_delay_seconds",
            "transcript delta delay: from the arrival of the newest input frame an STT step read to the "
            "bytes of that step's text being written to the socket (the model's text delay, "
            "parley_engine_stt*_model_delay_seconds, comes on top); path: paired or standalone row",
            ["path"], buckets=TRANSCRIPT_DELAY_BUCKETS, registry=r)
        self.codec_restarts = Counter("parley_codec_worker_restarts", "codec worker processes restarted after "
                                      "a crash or hang", registry=r)
        self.codec_failures = Counter("parley_codec_failures", "sessions closed because their codec worker "
                                      "was lost", ["protocol"], registry=r)
        if codec_cpu_seconds is not None:
            r.register(_WorkerCPUCollector("parley_codec_worker_cpu_seconds", "codec", codec_cpu_seconds))
        self.webrtc_restarts = Counter("parley_webrtc_worker_restarts", "WebRTC worker processes restarted after "
                                       "a crash or hang (each ended its own calls)", registry=r)
        self.webrtc_silent = Counter("parley_webrtc_silent_packets", "20 ms packets WebRTC calls' tracks sent as "
                                     "silence because no model audio was ready (a call's start, or late audio)",
                                     registry=r)
        if webrtc_cpu_seconds is not None:
            r.register(_WorkerCPUCollector("parley_webrtc_worker_cpu_seconds", "WebRTC", webrtc_cpu_seconds))
        self.protocol_errors = Counter("parley_protocol_errors", "bad client input answered with an error or close",
                                       ["protocol"], registry=r)
        self.rate_limited = Counter("parley_rate_limited", "connections closed for sending over the message or "
                                    "byte rate limit", ["protocol"], registry=r)
        self.lag_dropped = Counter("parley_lag_dropped_frames", "output frames dropped because their client was "
                                   "more than the lag limit behind", ["protocol"], registry=r)
        self.refusals = Refusals(r)  # parley_refusals_total{door, reason}: every refusal (sessions/refusals.py)
        _process_collectors(r, threads, engine_counters)
        self.process, self._others = process, others  # an edge worker: its scrape shows every process

    def render(self) -> bytes:
        if self._others is None:
            return generate_latest(self.registry)
        assert self.process is not None, "an edge worker's metrics name its process"
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_Merged(lambda: parsed([exposition(self.registry.collect(), self.process), *self._others()])))
        return generate_latest(merged)


async def metrics(request: Request) -> Response:
    return Response(app_state(request).sessions.metrics.render(), media_type=CONTENT_TYPE_LATEST)
