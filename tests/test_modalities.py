"""The modality registry (server/modalities.py): each modality is one record, and the CLI, the
services builder, the doors table, the app's routes, metrics and shutdown, and GET /v1/models loop
over it. So the records must be consistent (one key each, every door needing a known one, every
name they give resolving), and a record added to the registry is served with nothing else edited.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parley.realtime.cli import build_parser
from parley.realtime.server import doors
from parley.realtime.server.modalities import MODALITIES, resolve
from parley.realtime.server.serve import ServeConfig
from parley.realtime.server.services import Services

TESTS = Path(__file__).resolve().parent


def serve_parser():
    return build_parser()._subparsers._group_actions[0].choices["serve"]


def test_every_record_is_consistent_with_what_loops_over_it():
    keys = [m.key for m in MODALITIES]
    assert len(set(keys)) == len(keys)
    for door in doors.DOORS:  # a door needs a modality key, the page, or nothing
        assert door.needs in {*keys, "page", None}, door
        assert door.path == "/" or callable(resolve(door.endpoint)), door
    dests = {action.dest for action in serve_parser()._actions}
    config_fields = {f.name for f in dataclasses.fields(ServeConfig)}
    service_fields = {f.name for f in dataclasses.fields(Services)}
    for modality in MODALITIES:
        assert set(modality.settings) <= dests & config_fields, modality.key  # flags copied into ServeConfig
        assert modality.field is None or modality.field in service_fields, modality.key
        for ref in (modality.load, modality.start):
            assert ref is None or callable(resolve(ref)), (modality.key, ref)


def test_one_key_per_modality_everywhere():
    """The image doors needed "images" while its served names were "image": one spelling now, the
    one --served-model-name takes and /v1/models reports."""
    assert {door.needs for door in doors.DOORS} - {None, "page"} <= {m.key for m in MODALITIES}
    assert set(doors.NEEDS) == {"page", *(m.key for m in MODALITIES)}
    assert [d.path for d in doors.mounted({"page": False, "duplex": True, "tts": False, "stt": False,
                                           "image": True}) if d.needs] == ["/v1/images/generations"]
    text = serve_parser().format_help()
    assert "(modalities: duplex, tts, stt, image, translation; repeatable)" in " ".join(text.split())


# A fresh interpreter adds one record, a door set of its own with a service, a flag, a served
# name, a metric and a shutdown, before the server's modules are imported, then serves it.
ADD_A_RECORD = '''
import dataclasses, json, sys
from prometheus_client.core import GaugeMetricFamily
from parley.realtime.server import modalities

closed = []

@dataclasses.dataclass(eq=False)  # a collector: registered by identity
class Echo:
    model: str
    def collect(self):
        family = GaugeMetricFamily("parley_echo_ready", "the echo modality's own metric")
        family.add_metric([], 1.0)
        yield family

def echo_flags(p):
    p.add_argument("--echo-model", default=None, help="the echo modality's model")

ECHO = modalities.Modality(
    "echo", "echo model", "/v1/echo", "--echo-model",
    doors=(modalities.Door("/v1/echo", "GET", "the served models, echoed", "http.models:models_endpoint", "echo"),),
    add_flags=echo_flags, field="echo", collector=lambda echo: echo, close=closed.append)
modalities.MODALITIES = (*modalities.MODALITIES, ECHO)

import httpx2 as httpx
from delay_backend import DelayBackend
from server_harness import serve
from parley.engine import Engine
from parley.realtime.cli import build_parser
from parley.realtime.server.app import ServerInfo, create_app
from parley.realtime.server.services import Services

@dataclasses.dataclass
class EchoServices(Services):  # the typed field its doors read
    echo: Echo | None = None

out = {}
serve_help = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
out["help"] = serve_help
for echo in (Echo("echo-1"), None):
    app = create_app(EchoServices(Engine(DelayBackend(1)), info=ServerInfo(model="delay"), codec_workers=0,
                                  web_dir=None, echo=echo))
    with serve(app) as base:
        door = httpx.get(f"http://{base}/v1/echo", timeout=30)
        models = httpx.get(f"http://{base}/v1/models", timeout=30).json()["data"]
        metrics = httpx.get(f"http://{base}/metrics", timeout=30).text
    out["served" if echo else "unserved"] = {
        "door": [door.status_code, door.json()], "models": [[m["id"], m["modality"]] for m in models],
        "metric": "parley_echo_ready 1.0" in metrics}
out["closed"] = [echo.model for echo in closed]
print(json.dumps(out))
'''


@pytest.mark.timeout(180)
def test_adding_a_record_serves_a_modality_with_nothing_else_edited():
    done = subprocess.run([sys.executable, "-c", ADD_A_RECORD], cwd=TESTS, capture_output=True, text=True,
                          timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert re.search(r"^  GET +/v1/echo +the served models, echoed \[--echo-model\]$", out["help"], re.M)
    assert "--echo-model ECHO_MODEL" in out["help"] and "the echo modality's model" in out["help"]
    served, unserved = out["served"], out["unserved"]
    assert served["door"][0] == 200
    assert ["echo-1", "echo"] in served["models"] and ["delay", "duplex"] in served["models"]
    assert served["metric"] and not unserved["metric"]
    status, body = unserved["door"]  # not served: OpenAI's 404 naming the flag that serves it
    assert status == 404 and "--echo-model" in body["error"]["message"]
    assert ["echo-1", "echo"] not in unserved["models"]
    assert out["closed"] == ["echo-1"]  # its shutdown ran once, for the server that had it
