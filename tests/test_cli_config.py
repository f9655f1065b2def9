"""`parley serve` settings from flags, PARLEY_* environment variables and a TOML file: the same
effective settings whichever way they come, precedence flag > env > file > default, and a flag
nobody taught the mechanism about works the same way."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from parley.realtime.server import cli_sources
from parley.realtime.cli import build_parser
from parley.realtime.server.log_format import configure_logging
from parley.realtime.server.serve import ServeError, resolve_device

FLAGS = ["--max-sessions", "3", "--port", "9100", "--device", "cpu", "--kv-dtype", "fp8", "--text-temperature",
         "0.5", "--persona", "Be brief.", "--log-level", "debug", "--log-format", "json"]
ENV = {"PARLEY_MAX_SESSIONS": "3", "PARLEY_PORT": "9100", "PARLEY_DEVICE": "cpu", "PARLEY_KV_DTYPE": "fp8",
       "PARLEY_TEXT_TEMPERATURE": "0.5", "PARLEY_PERSONA": "Be brief.", "PARLEY_LOG_LEVEL": "debug",
       "PARLEY_LOG_FORMAT": "json"}
TOML = '''max_sessions = 3
port = 9100
device = "cpu"
kv_dtype = "fp8"
text_temperature = 0.5
persona = "Be brief."
log_level = "debug"
log-format = "json"
'''


def parse(argv, environ=None):
    args = cli_sources.parse_args(build_parser(), ["serve", *argv], environ or {})
    return {k: v for k, v in vars(args).items() if k not in ("handler", "config")}


def test_flags_env_and_file_give_the_same_settings(tmp_path):
    path = tmp_path / "parley.toml"
    path.write_text(TOML)
    from_flags = parse(FLAGS)
    assert from_flags["max_sessions"] == 3 and from_flags["text_temperature"] == 0.5
    assert parse([], ENV) == from_flags
    assert parse(["--config", str(path)]) == from_flags
    assert parse([], {"PARLEY_CONFIG": str(path)}) == from_flags
    defaults = parse([])
    assert defaults["max_sessions"] == 8 and defaults["device"] == "auto" and defaults["log_format"] == "text"


def test_precedence_flag_then_env_then_file_then_default(tmp_path):
    path = tmp_path / "parley.toml"
    path.write_text("max_sessions = 2\nport = 7000\nhost = '0.0.0.0'\n")
    got = parse(["--config", str(path), "--max-sessions", "5"], {"PARLEY_MAX_SESSIONS": "4", "PARLEY_PORT": "7100"})
    assert got["max_sessions"] == 5  # flag
    assert got["port"] == 7100  # env over file
    assert got["host"] == "0.0.0.0"  # file over default
    assert got["torch_threads"] == 1  # default


@pytest.mark.parametrize("environ,toml,needle", [
    ({"PARLEY_MAX_SESSIONS": "many"}, None, "PARLEY_MAX_SESSIONS"),
    ({"PARLEY_KV_DTYPE": "int4"}, None, "PARLEY_KV_DTYPE"),
    ({}, "max_sesions = 3\n", "unknown setting 'max_sesions'"),
    ({}, "port = [1, 2]\n", "port"),
    ({}, "port = \n", "not valid TOML"),
])
def test_bad_values_are_refused_naming_their_source(tmp_path, capsys, environ, toml, needle):
    argv = []
    if toml is not None:
        path = tmp_path / "parley.toml"
        path.write_text(toml)
        argv = ["--config", str(path)]
    with pytest.raises(SystemExit) as exit_:
        parse(argv, environ)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_flag_added_later_gets_env_and_file_for_free(tmp_path):
    parser = argparse.ArgumentParser(prog="parley")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve")
    serve.add_argument("--rate-limit-per-s", type=int, default=100)
    serve.add_argument("--strict-origin", action="store_true")
    serve.add_argument("--no-ping", dest="ping", action="store_false")
    cli_sources.install(serve)
    args = cli_sources.parse_args(parser, ["serve"], {"PARLEY_RATE_LIMIT_PER_S": "7", "PARLEY_STRICT_ORIGIN": "true"})
    assert args.rate_limit_per_s == 7 and args.strict_origin is True and args.ping is True
    assert cli_sources.parse_args(parser, ["serve"], {"PARLEY_PING": "off"}).ping is False
    path = tmp_path / "p.toml"
    path.write_text("strict_origin = true\nrate_limit_per_s = 9\n")
    args = cli_sources.parse_args(parser, ["serve", "--config", str(path), "--rate-limit-per-s", "1"], {})
    assert args.rate_limit_per_s == 1 and args.strict_origin is True


def test_help_names_the_environment_variables(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "[env PARLEY_MAX_SESSIONS]" in text and "--config" in text and "Precedence: flag" in text


def test_json_logs_carry_uvicorns_lines_too(capsys):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    configure_logging("info", "json")
    try:
        logging.getLogger("uvicorn.error").info("Uvicorn running")
        logging.getLogger("parley.server").warning("hello %s", "there")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert [(e["logger"], e["level"], e["message"]) for e in lines] == [
        ("uvicorn.error", "INFO", "Uvicorn running"), ("parley.server", "WARNING", "hello there")]
    assert all(e["time"].endswith("+00:00") for e in lines)


def test_checkpoint_load_reports_progress_as_log_lines_off_a_terminal(tiny_moshi_dir, caplog):
    import io

    import torch

    from parley.models.checkpoint import load_checkpoint
    from parley.realtime.server.load_progress import LoadProgress

    calls = []
    progress = LoadProgress(io.StringIO())  # not a terminal: periodic log lines, no bar

    def spy(what, done, total):
        calls.append((what, done, total))
        progress(what, done, total)

    with caplog.at_level(logging.INFO, logger="parley.server"):
        load_checkpoint(tiny_moshi_dir, dtype=torch.float32, progress=spy)
    assert {c[0] for c in calls} == {"LM weights", "Mimi weights"}
    assert all(c[1] == i + 1 for what in ("LM weights", "Mimi weights")
               for i, c in enumerate(c for c in calls if c[0] == what))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("loading LM weights: 100%") for line in lines)
    assert any(line.startswith("loading Mimi weights: 100%") for line in lines)


@pytest.mark.parametrize("device,needle", [
    ("bogus", "'bogus' is not a device"),
    ("mps", "Parley runs on cpu or cuda"),
    ("cuda:99", "cuda:99"),
])
def test_a_device_this_machine_lacks_is_refused_before_anything_loads(capsys, device, needle):
    for argv in (["transcribe", "--model", "m", "--device", device, "in.wav"],
                 ["tts", "--model", "m", "--text", "a", "--voice", "v", "--output", "o.wav", "--device", device]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(argv)
        assert exit_.value.code == 2
        assert "argument --device" in (err := capsys.readouterr().err) and needle in err, err
    with pytest.raises(ServeError, match=needle):
        resolve_device(device)


def test_a_taken_port_is_refused_before_anything_loads():
    """`parley serve` beside a server on its port: one line naming the address, exit 2, and no
    model stack loaded (it used to load every model, then exit on uvicorn's bind error)."""
    import socket
    import subprocess
    import sys

    script = ("import sys\nfrom parley.realtime.cli import main\ncode = main(sys.argv[1:])\n"
              "print('torch' in sys.modules, code)")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-c", script, "serve", "--host", "127.0.0.1", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "2"], done.stderr
    assert done.stderr.splitlines() == [f"parley serve: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_the_server_answers_on_the_sockets_bound_before_loading():
    """run_app serves on the sockets handed to it: uvicorn's own address (another port) stays unbound."""
    import threading
    import time
    import urllib.request

    from parley.engine import Engine
    from delay_backend import DelayBackend
    from parley.realtime.server.app import create_app
    from parley.realtime.server.services import Services
    from parley.realtime.server.serve import run_app, uvicorn_config
    from parley.realtime.server.sockets import bind
    from server_harness import free_port

    app = create_app(Services(Engine(DelayBackend(1)), web_dir=None))
    [sock] = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(
        run_app(app, uvicorn_config(app, "127.0.0.1", free_port(), log_level="warning"), [sock])))
    thread.start()
    deadline = time.monotonic() + 30
    try:
        while True:  # refused until uvicorn has started and listens on it
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=5) as r:
                    status = r.status
                break
            except OSError:
                assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
    finally:
        app.state.sessions.engine.on_fatal(RuntimeError("stop the test server"))  # run_app's stop hook
        thread.join(30)
    assert status == 200 and result == [1]


@pytest.mark.parametrize(("argv", "environ", "depth"), [([], {}, 2), (["--slack-queue-depth", "1"], {}, 1),
                                                       ([], {"PARLEY_SLACK_QUEUE_DEPTH": "3"}, 3)])
def test_slack_queue_depth_reaches_the_engine_config(argv, environ, depth):
    """--slack-queue-depth (or its environment variable) is the EngineConfig the engine is built with."""
    from parley.engine import EngineConfig, KvSettings, SessionOptions
    from parley.realtime.cli import _serve_config, serve_flag_error
    from parley.realtime.server.services import _engine_config

    args = cli_sources.parse_args(build_parser(), ["serve", *argv], environ)
    assert serve_flag_error(args) is None
    config = _serve_config(args, SessionOptions(), {}, KvSettings(), {})
    assert _engine_config(config, cuda=True) == EngineConfig(slack_queue_depth=depth)


def test_slack_queue_depth_past_one_is_refused_off_cuda_naming_the_flag():
    from parley.engine import EngineConfig, KvSettings, SessionOptions
    from parley.realtime.cli import _serve_config
    from parley.realtime.server.services import ServeError, _engine_config

    def config(argv):
        args = cli_sources.parse_args(build_parser(), ["serve", *argv], {})
        return _serve_config(args, SessionOptions(), {}, KvSettings(), {})

    with pytest.raises(ServeError, match="--slack-queue-depth 3: slack items queue on CUDA only"):
        _engine_config(config(["--slack-queue-depth", "3"]), cuda=False)
    assert _engine_config(config(["--slack-queue-depth", "1"]), cuda=False) == EngineConfig(slack_queue_depth=1)
    assert _engine_config(config([]), cuda=False) == EngineConfig()  # the default: nothing to refuse


@pytest.mark.parametrize("value", ["0", "-2"])
def test_slack_queue_depth_below_one_is_refused_naming_the_flag(value):
    from parley.realtime.cli import serve_flag_error

    args = cli_sources.parse_args(build_parser(), ["serve", "--slack-queue-depth", value], {})
    assert serve_flag_error(args) == f"--slack-queue-depth must be at least 1 (got {value})"


def test_slack_queue_depth_has_a_help_line(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--slack-queue-depth N" in help_text and "1: wait for each item before choosing the next" in help_text


@pytest.mark.parametrize(("argv", "error"), [
    (["--edge-workers", "-1"], "--edge-workers must be 0 (one process) or more (got -1)"),
    (["--edge-workers", "2", "--codec-workers", "2"], "--codec-workers applies with --edge-workers 0"),
    (["--codec-workers", "2"], None),  # one process (their default): the codec's own workers
    (["--edge-workers", "2"], None),
    (["--edge-workers", "2", "--webrtc-workers", "3"], "--webrtc-workers applies with --edge-workers 0"),
    (["--edge-workers", "1", "--webrtc-workers", "1"], "--webrtc-workers applies with --edge-workers 0"),
    (["--webrtc-workers", "3"], None),  # one process (their default): the WebRTC worker processes
])
def test_edge_workers_and_the_worker_pools_they_replace(argv, error):
    from parley.realtime.cli import serve_flag_error

    args = cli_sources.parse_args(build_parser(), ["serve", *argv], {})
    found = serve_flag_error(args)
    assert (found is None) if error is None else (found is not None and found.startswith(error)), found


@pytest.mark.parametrize(("argv", "cuda", "cores", "workers"), [
    ([], True, 16, 8),  # on CUDA: one per core but the engine's, at most 8
    ([], True, 4, 3),
    ([], True, 1, 0),
    (["--device", "cuda:1"], False, 16, 8),  # named, not probed
    ([], False, 16, 0),  # the CPU's own inference needs the cores
    (["--device", "cpu"], True, 16, 0),
    (["--codec-workers", "2"], True, 16, 0),  # the one-process server's pools chosen
    (["--webrtc-workers", "3"], True, 16, 0),
    (["--edge-workers", "2"], False, 16, 2),  # given: as given
    (["--edge-workers", "0"], True, 16, 0),
])
def test_edge_workers_default_follows_the_cores_on_cuda(argv, cuda, cores, workers, monkeypatch):
    from parley.realtime import cli

    monkeypatch.setattr(cli, "usable_cpus", lambda: cores)
    args = cli_sources.parse_args(build_parser(), ["serve", *argv], {})
    assert cli.serve_flag_error(args) is None
    assert cli.edge_workers(args, lambda: cuda) == workers


@pytest.mark.parametrize(("cpu_max", "affinity", "cpus"), [
    (None, 16, 16),  # no cgroup v2 file: the affinity
    ("max 100000\n", 16, 16),  # no quota
    ("200000 100000\n", 16, 2),  # a 2-CPU container on a 16-core host
    ("150000 100000\n", 16, 2),  # a part CPU counts whole
    ("50000 100000\n", 16, 1),
    ("800000 100000\n", 4, 4),  # taskset to 4 under a larger quota
    ("garbled\n", 16, 16),
])
def test_usable_cpus_follows_the_affinity_and_a_containers_cpu_quota(cpu_max, affinity, cpus, tmp_path,
                                                                      monkeypatch):
    from parley.realtime.server import workers

    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert workers.usable_cpus(str(path)) == cpus
