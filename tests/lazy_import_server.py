"""The demo server (`parley serve` with no model) in this process, for test_lazy_imports.py:
prints READY once serving, then, for each line read from stdin, the modules imported since the
previous report as one JSON line (`NEW [...]`)."""

import json
import sys
import threading
import time

import uvicorn

from parley.realtime.server.serve import ServeConfig, build_app, uvicorn_config

port = int(sys.argv[1])
server = uvicorn.Server(uvicorn_config(build_app(ServeConfig(model=None, port=port)), "127.0.0.1", port,
                                       log_level="warning"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.02)
seen = set(sys.modules)
print("READY", flush=True)
for _ in sys.stdin:
    now = set(sys.modules)
    print("NEW " + json.dumps(sorted(now - seen)), flush=True)
    seen = now
server.should_exit = True
