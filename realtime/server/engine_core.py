"""The engine process: the models, the engine's tick thread and the GPU, and no socket but its
link to the edge workers (realtime/engine_process/core.py).

`engine_process` is the target the supervisor (server/processes.py) starts. Top to bottom: build
the services as a one-process server does (server/services.py), start the engine, serve the
workers' links on a Unix socket, tell the supervisor it is ready, then run until SIGTERM or
SIGINT (shut the engine down, close each modality's service, exit 0) or a fatal engine error
(exit 1: the supervisor starts a new engine process, and the workers link to it). A
configuration that cannot be served exits 2 before the ready message, and the supervisor stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

from parley.engine import freeze_loaded_objects
from parley.models import CheckpointError

from ..engine_process.core import CoreServer
from ..http.metrics import engine_registry
from .app import engine_client
from .log_format import configure_logging
from .serve import runner
from .services import ServeError, Services, build_services

log = logging.getLogger("parley.engine_process")
EXIT_CONFIG = 2  # the configuration cannot be served: the supervisor does not start another


def engine_process(config, path: str, ready: Connection, log_format: str) -> None:
    """The engine process's main (module docstring); `ready` gets one message once workers may link."""
    configure_logging(config.log_level, log_format)
    try:
        services = build_services(config)
    except (ServeError, CheckpointError) as exc:
        log.error("%s", exc)
        sys.exit(EXIT_CONFIG)
    log.info("froze %d loaded objects out of garbage collection", freeze_loaded_objects())
    with runner() as run:
        sys.exit(run.run(_serve(services, path, ready)))


async def _serve(services: Services, path: str, ready: Connection) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fatal: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:  # the engine thread
        fatal.append(exc)
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = engine_client(services)
    registry = engine_registry(client.counters, lambda: services.engine.thread_id, services.collectors())
    core = CoreServer(client, services.edge_spec(), has_tts=services.speech is not None,
                      has_stt=services.stt_pool is not None, has_images=services.images is not None,
                      registry=registry)
    services.engine.on_fatal = on_fatal
    services.engine.start(beside_sockets=False)  # the clients' sockets are the edge workers'
    server = await core.serve(path)
    ready.send(os.getpid())
    log.info("engine process %d ready: %d sessions; edge workers link at %s", os.getpid(),
             client.max_sessions, path)
    await stop.wait()
    server.close()
    await asyncio.to_thread(services.engine.shutdown)
    services.close_modalities()
    if fatal:
        log.error("the engine failed (%s): exiting with status 1; the supervisor starts another", fatal[0])
        return 1
    return 0

