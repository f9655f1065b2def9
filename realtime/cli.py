"""The `parley` command. Each subcommand is one `add_<name>(subparsers)` function that
registers its flags and sets `handler`; `main` only parses and dispatches.

    parley serve [--model DIR_OR_REPO] [--host H] [--port P] [--max-sessions N] ...
    parley offline --model DIR --input-wav IN --output-wav OUT [--output-text OUT.json] ...
    parley tts --model DIR --text TEXT --voice NAME --output OUT.wav [--voices DIR] ...
    parley transcribe --model STT_DIR_OR_REPO IN.wav [--format text|json]
    parley launch (--gpus 0-7 | --workers N --device cpu) [--port P] [--base-port B] -- [serve flags]
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable, Sequence

# Only torch-free modules here: `parley --help` must not wait for torch (tests/test_lazy_imports.py).
# Each handler imports what its command needs when it runs.
from parley.engine import TICK_TRACE_TICKS, EngineConfig, KvSettings, OptionsError, SamplingOptions, SessionOptions

from .server import cli_sources, doors
from .server.modalities import MODALITIES
from .server.help_format import HelpFormatter
from .server.launch import add_launch
from .sessions.limits import WS_MAX_SIZE, EdgeLimits
from .live.policy import DelegateBackend, parse_policy
from .server.log_format import LOG_FORMATS, configure_logging
from .server.offline_cli import add_mimi_dtype_flag, add_offline
from .server.served_models import parse_served_names
from .server.sockets import bind
from .server.workers import usable_cpus
from .server.transcribe_cli import add_transcribe
from .server.tts_cli import add_tts

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help=f"run the realtime server ({doors.help_summary()}, probes, /metrics)",
        description="Serve a Moshi-family model over WebSockets: the Moshi/PersonaPlex protocol on "
                    "/api/chat and the OpenAI Realtime API on /v1/realtime. With no --model, a tiny "
                    "demo model is generated on first run and served: it babbles.\n\n"
                    "Doors (one in [brackets] is served only with what the brackets name):\n" + doors.help_table(),
        formatter_class=HelpFormatter)
    for modality in MODALITIES:  # each modality's own flags (server/modalities.py): --model, --tts-model, ...
        modality.add_flags(p)
    add_served_name_flag(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 to accept connections from other machines")
    p.add_argument("--port", type=int, default=8998, help="TCP port to listen on")
    p.add_argument("--max-sessions", type=int, default=8,
                   help="concurrent conversations (engine slots); one more is refused (HTTP 503 at the upgrade)")
    p.add_argument("--device", default="auto",
                   help="torch device: auto (CUDA when present, else CPU; the log says which), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weight dtype (default: bfloat16 on CUDA, float32 on CPU)")
    add_mimi_dtype_flag(p, "of every model served")
    add_process_flags(p)
    add_reliability_flags(p)
    p.set_defaults(handler=run_serve)


def add_process_flags(p: argparse.ArgumentParser) -> None:
    """The server process: codec workers, torch threads, readiness, drain and logs."""
    p.add_argument("--codec-workers", type=int, default=None,
                   help="Ogg-Opus codec worker processes (sessions pinned to one each, off the server's GIL); "
                        "0: a thread pool in the server process (fine for a few sessions). Default: 0 up to 8 "
                        "sessions, else one process per 32 sessions (at most CPU cores - 1)")
    p.add_argument("--webrtc-workers", type=int, default=None,
                   help="with --edge-workers 0: worker processes for WebRTC calls (aiortc's Opus, SRTP, DTLS "
                        "and SCTP, off the event loop whose GIL the engine thread shares; each call pinned to the "
                        "least loaded; started by the first call). Default: one per 6 sessions (at most CPU "
                        "cores - 1). Edge workers run their calls' peers themselves")
    p.add_argument("--edge-workers", type=int, default=None,
                   help="edge worker processes: each serves its connections end to end (protocol, codec, WebRTC "
                        "peers) on the shared port, while the models and the engine's tick run in an engine "
                        "process of their own; a worker or engine process that dies is restarted. A WebRTC call's "
                        "peer runs on its worker's loop: for many calls, about one worker per 7 "
                        "(docs/benchmarks.md). 0: one process "
                        "does everything (the engine thread shares the event loop's GIL). Default: on CUDA one "
                        "per CPU core but one, at most 8; on the CPU, or with --codec-workers or "
                        "--webrtc-workers, 0")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op CPU threads; more than 1 only pays off for CPU inference of large "
                        "models on a machine with cores to spare (OpenMP workers spin and starve the "
                        "network edge)")
    p.add_argument("--ready-min-free", type=int, default=1,
                   help="/readyz answers 503 when fewer slots than this are free (a balancer then sends "
                        "new sessions elsewhere); 0: ready even when full")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM or POST /admin/drain: refuse new sessions, let live ones run up to this "
                        "many seconds, then close them (1001) and exit; 0: close at once on SIGTERM")
    p.add_argument("--slack-queue-depth", type=int, default=None, metavar="N",
                   help="on CUDA, slack work items (TTS, transcription, prompt prefill and image steps between "
                        "ticks) queued on the GPU back to back, up to N in flight, without the host waiting for "
                        "each; each is fitted before the next tick by the estimated end of the work queued. "
                        f"1: wait for each item before choosing the next (default {EngineConfig.slack_queue_depth}; "
                        "more than 1 is refused off CUDA, where each item ends before the next)")
    p.add_argument("--tick-trace", default=None, metavar="PATH",
                   help="write the engine's tick timeline to PATH, one JSON line per tick: host phases, slack "
                        "items and, on CUDA, device times (benchmarks/tick_timeline.py reads it); off by default")
    p.add_argument("--tick-trace-ticks", type=int, default=None, metavar="N",
                   help=f"with --tick-trace: ticks written at most, then tracing stops (default {TICK_TRACE_TICKS})")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging verbosity")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="log lines (Parley's and uvicorn's alike): text with timestamps, or json (one object a "
                        "line, for log collectors)")


def add_served_name_flag(p: argparse.ArgumentParser) -> None:
    """The names each modality's model answers to (server/served_models.py), keyed by its record's key."""
    p.add_argument("--served-model-name", action="append", default=None, metavar="MODALITY=NAME[,NAME...]",
                   help="names a modality's model answers to beside its checkpoint's name, e.g. tts=tts-1,kyutai-tts "
                        f"(modalities: {', '.join(m.key for m in MODALITIES if m.named)}; repeatable). A request "
                        "naming another model gets 404 model_not_found; GET /v1/models lists them")


# ---- security and per-connection limits (docs/reliability.md) ----

def add_reliability_flags(p: argparse.ArgumentParser) -> None:
    limits = EdgeLimits()
    p.add_argument("--api-key", default=None,
                   help="require this key on every door except the page, its files and the health probes "
                        "(/api/chat, /v1/realtime, /api/*, ...): 'Authorization: Bearer <key>', ?api_key=<key> "
                        "or the WebSocket subprotocol openai-insecure-api-key.<key>")
    p.add_argument("--api-key-file", default=None,
                   help="read the key(s) from this file instead, one per line (several: rotation)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="/metrics needs the key too (default: open, for scrapers)")
    p.add_argument("--allowed-origins", default=None,
                   help="browser Origins allowed to open WebSockets, comma-separated (https://app.example.com), "
                        "* for any. Default: the server's own origin (the built-in page works); requests "
                        "without an Origin header (non-browser clients) are not checked")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS/WSS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    p.add_argument("--max-messages-per-s", type=float, default=limits.max_messages_per_s,
                   help="per-connection message rate (bursts of 2 s allowed); over it: close 1008")
    p.add_argument("--max-bytes-per-s", type=float, default=limits.max_bytes_per_s,
                   help="per-connection byte rate (bursts of 2 s allowed); over it: close 1008")
    p.add_argument("--max-lag-s", type=float, default=limits.max_lag_s,
                   help="output a client may fall behind (bytes queued for it, in seconds of audio) before "
                        "its oldest unsent frames are dropped, counted")
    p.add_argument("--max-event-bytes", type=int, default=limits.max_event_bytes,
                   help="largest /v1/realtime event (larger: an error event)")
    p.add_argument("--max-conversation-bytes", type=int, default=limits.max_conversation_bytes,
                   help="/v1/realtime conversation items kept per session (over it: the item is refused)")
    p.add_argument("--max-sidebands", type=int, default=limits.max_sidebands,
                   help="server connections that may attach to one live call (GPT-Live's /v1/live/sessions/ID/attach, "
                        "Realtime's /v1/realtime?call_id=ID); past it: 429. 0: none")
    p.add_argument("--live-delegation", default="every_turn", metavar="POLICY",
                   help="GPT-Live (/v1/live/sessions): when a session delegates to its client: every_turn (at "
                        "the end of each user turn), never, or pattern:REGEX (turns whose input transcript "
                        "matches; needs --stt-model)")
    p.add_argument("--delegate-url", metavar="URL",
                   help="GPT-Live Responses delegation: an OpenAI-compatible backend's base URL (e.g. "
                        "http://127.0.0.1:8000/v1, a `vllm serve` of an instruction model with tool calls); "
                        "without it, sessions asking for responses delegation are refused")
    p.add_argument("--delegate-api-key-file", metavar="PATH",
                   help="the key --delegate-url takes (the file's first key); none by default")
    p.add_argument("--ice-servers", metavar="URLS",
                   help="WebRTC calls (/v1/realtime/calls, POST /v1/live/sessions, the page): STUN/TURN servers, "
                        "comma-separated (stun:stun.example.com:3478,turn:turn.example.com:3478?transport=udp); "
                        "the server's ICE and the page's use them. Default: none, host candidates only (a peer "
                        "that can reach this host directly: the same machine or network)")
    p.add_argument("--turn-username", metavar="NAME", help="the TURN servers' username (with --turn-credential-file)")
    p.add_argument("--turn-credential-file", metavar="PATH",
                   help="the TURN servers' credential (the file's first non-comment line)")


def reliability_settings(args: argparse.Namespace) -> dict:
    """ServeConfig fields from the flags above; raises ValueError with a sentence naming the flag."""
    from .server.security import parse_origins, read_key_file  # starlette: only once serving
    from .calls.transport import parse_ice_servers

    if args.api_key and args.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    keys = read_key_file(args.api_key_file) if args.api_key_file else args.api_key
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    if args.max_sidebands < 0:
        raise ValueError(f"--max-sidebands must be 0 or more, not {args.max_sidebands}")
    if args.max_event_bytes > WS_MAX_SIZE:
        raise ValueError(f"--max-event-bytes must be at most {WS_MAX_SIZE} (the WebSocket message cap)")
    limits = EdgeLimits(max_messages_per_s=args.max_messages_per_s, max_bytes_per_s=args.max_bytes_per_s,
                        max_lag_s=args.max_lag_s, max_event_bytes=args.max_event_bytes,
                        max_conversation_bytes=args.max_conversation_bytes, max_sidebands=args.max_sidebands)
    if args.delegate_api_key_file and not args.delegate_url:
        raise ValueError("--delegate-api-key-file is the key of --delegate-url: give both")
    delegate = DelegateBackend(args.delegate_url, read_key_file(args.delegate_api_key_file)[0]
                               if args.delegate_api_key_file else None) if args.delegate_url else None
    if delegate is not None and not delegate.url.startswith(("http://", "https://")):
        raise ValueError(f"--delegate-url {delegate.url!r:.80} is not an http(s) URL")
    credential = read_key_file(args.turn_credential_file)[0] if args.turn_credential_file else None
    ice_servers = parse_ice_servers(args.ice_servers, args.turn_username, credential)
    return {"api_key": keys, "protect_metrics": args.protect_metrics, "ice_servers": ice_servers,
            "live_delegation": parse_policy(args.live_delegation), "live_delegate": delegate,
            "allowed_origins": parse_origins(args.allowed_origins), "ssl_certfile": args.ssl_certfile,
            "ssl_keyfile": args.ssl_keyfile, "limits": limits}


def served_names(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """--served-model-name's aliases; the environment or --config give one string, not a list."""
    values = args.served_model_name
    return parse_served_names([values] if isinstance(values, str) else values or [])


def serve_flag_error(args: argparse.Namespace) -> str | None:
    """What is wrong with `parley serve`'s numeric flags and each modality's (None: nothing), before
    anything loads."""
    if args.codec_workers is not None and args.codec_workers < 0:
        return "--codec-workers must be 0 (threads) or more (processes)"
    if args.webrtc_workers is not None and args.webrtc_workers < 1:
        return f"--webrtc-workers must be at least 1 (got {args.webrtc_workers}); WebRTC calls always run in workers"
    if args.edge_workers is not None and args.edge_workers < 0:
        return f"--edge-workers must be 0 (one process) or more (got {args.edge_workers})"
    if args.codec_workers and args.edge_workers:
        return ("--codec-workers applies with --edge-workers 0: each edge worker runs its connections' codec "
                "on its own threads")
    if args.webrtc_workers is not None and args.edge_workers:
        return ("--webrtc-workers applies with --edge-workers 0: each edge worker runs its WebRTC calls' peers "
                "on its own event loop")
    if args.max_sessions < 1:
        return "--max-sessions must be at least 1"
    if args.ready_min_free < 0 or args.drain_timeout < 0:
        return "--ready-min-free and --drain-timeout must be 0 or more"
    if args.slack_queue_depth is not None and args.slack_queue_depth < 1:
        return f"--slack-queue-depth must be at least 1 (got {args.slack_queue_depth})"
    if (wrong := tick_trace_error(args)) is not None:
        return wrong
    return next(filter(None, (modality.flag_error(args) for modality in MODALITIES)), None)


MAX_DEFAULT_EDGE_WORKERS = 8  # past this many, the engine process's relaying grows and the cores are the clients'


def edge_workers(args: argparse.Namespace, cuda_available: Callable[[], bool]) -> int:
    """--edge-workers, or its default. On CUDA the engine process keeps a core and the tick to itself
    (docs/benchmarks.md: the split held duplex jitter far better under every kind of work at once);
    on the CPU the engine's own inference needs the cores, and --codec-workers or --webrtc-workers
    name the one-process server's pools, so those default to one process."""
    if args.edge_workers is not None:
        return args.edge_workers
    if args.codec_workers is not None or args.webrtc_workers is not None:
        return 0
    on_cuda = args.device.startswith("cuda") or (args.device == "auto" and cuda_available())
    return min(MAX_DEFAULT_EDGE_WORKERS, usable_cpus() - 1) if on_cuda else 0


def _cuda_available() -> bool:
    import torch  # only to choose the default process layout for --device auto

    return torch.cuda.is_available()


def tick_trace_error(args: argparse.Namespace) -> str | None:
    """What is wrong with --tick-trace / --tick-trace-ticks (None: nothing); the file opens once serving."""
    if args.tick_trace is None:
        return "--tick-trace-ticks needs --tick-trace" if args.tick_trace_ticks is not None else None
    path = Path(args.tick_trace)
    if path.is_dir() or not path.parent.is_dir():
        return f"--tick-trace {args.tick_trace!r} must be a file in an existing directory"
    if args.tick_trace_ticks is not None and args.tick_trace_ticks < 1:
        return f"--tick-trace-ticks must be at least 1 (got {args.tick_trace_ticks})"
    return None


def run_serve(args: argparse.Namespace) -> int:
    given = {"text_temperature": args.text_temperature, "text_top_k": args.text_topk,
             "audio_temperature": args.audio_temperature, "audio_top_k": args.audio_topk}
    try:
        SamplingOptions(**{k: v for k, v in given.items() if v is not None})  # validate the flags now
        defaults = SessionOptions(persona=args.persona, voice=args.voice or None)
    except OptionsError as exc:
        print(f"parley serve: {exc}", file=sys.stderr)
        return 2
    if (wrong := serve_flag_error(args)) is not None:
        print(f"parley serve: {wrong}", file=sys.stderr)
        return 2
    try:
        reliability = {**reliability_settings(args), "served_model_names": served_names(args)}
        kv = KvSettings(policy=args.kv_policy, blocks=args.kv_blocks, memory_gib=args.kv_memory,
                        block_frames=args.kv_block_frames, attention=args.kv_attention)
    except (ValueError, OSError) as exc:
        print(f"parley serve: {exc}", file=sys.stderr)
        return 2
    try:  # before loading anything: a taken port is found at once (server/sockets.py)
        sockets = bind(args.host, args.port)
    except OSError as exc:
        print(f"parley serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    args.edge_workers = edge_workers(args, _cuda_available)
    config = _serve_config(args, defaults, {k: v for k, v in given.items() if v is not None}, kv, reliability)
    if config.edge_workers:
        from .server.processes import serve_processes  # torch and the models: only once serving

        return serve_processes(config, sockets, config.edge_workers)
    from .server.serve import serve

    return serve(config, sockets)


def _serve_config(args: argparse.Namespace, defaults: SessionOptions, sampling: dict, kv: KvSettings,
                  reliability: dict):
    """`parley serve`'s checked flags as the server's ServeConfig (imports the server: once serving)."""
    from .server.serve import ServeConfig  # torch and the models: only once serving

    return ServeConfig(host=args.host, port=args.port, max_sessions=args.max_sessions,
                       device=args.device, dtype=args.dtype, kv=kv,
                       mimi_dtype=args.mimi_dtype, defaults=defaults, sampling=sampling,
                       log_level=args.log_level, codec_workers=args.codec_workers,
                       webrtc_workers=args.webrtc_workers, torch_threads=args.torch_threads,
                       edge_workers=args.edge_workers,
                       ready_min_free=args.ready_min_free, drain_timeout=args.drain_timeout,
                       tick_trace=args.tick_trace, tick_trace_ticks=args.tick_trace_ticks or TICK_TRACE_TICKS,
                       slack_queue_depth=args.slack_queue_depth,
                       **{name: getattr(args, name) for modality in MODALITIES for name in modality.settings},
                       **reliability)


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (add_serve, add_offline, add_transcribe,
                                                                         add_launch, add_tts)


def installed_version() -> str:
    """The version pip installed (package metadata), so it can never disagree with pyproject.toml."""
    try:
        return version("parley")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parley", description="Realtime full-duplex speech server for "
                                                                "Moshi-family models.")
    parser.add_argument("--version", action="version", version=f"parley {installed_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add in SUBCOMMANDS:
        add(subparsers)
    # After every flag is registered, so flags added to `serve` later get env/file settings too.
    cli_sources.install(subparsers.choices["serve"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = cli_sources.parse_args(build_parser(), argv, os.environ)
    configure_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C before serving started (e.g. while loading): no traceback
        return 130


if __name__ == "__main__":
    sys.exit(main())
