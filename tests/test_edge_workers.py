"""`parley serve --edge-workers N`: the engine in its own process, the edge in worker processes.

The rings and the wire's records in one process, then the demo server with two edge workers over
real sockets: every kind of door through a worker (a WebRTC call's peer in the worker itself, no
WebRTC worker process), /metrics from every process, a killed worker
(only its sessions end; its slots free; it is restarted), a killed engine process (503 and a
failing /readyz until it is back; sessions end with 1011), and SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from parley.realtime.engine_client import FrameOut, Status, Terminal, TtsAudio
from parley.realtime.engine_process.rings import ByteRing
from parley.realtime.engine_process.wire import event_parts, input_parts, read_event, read_input
from server_harness import free_port, tone, webrtc_worker_pids
from test_launch import Holder, grows, hold, http, until

ROOT = Path(__file__).resolve().parents[1]


# ---- the rings and the records ----

def test_ring_records_round_trip_across_the_wrap_and_a_full_ring_refuses():
    ring = ByteRing.create(256)
    peer = ByteRing.attach(ring.name)  # the other side (here: this process) removes the name at once
    try:
        assert peer.read() is None
        records = [bytes([i]) * (30 + i) for i in range(40)]
        pending = []
        for record in records:  # far more bytes than the ring holds: writes wrap around it
            while not ring.write(record[:10], record[10:]):
                assert pending, "an empty ring refused a record that fits"
                assert peer.read() == pending.pop(0)
            pending.append(record)
        while pending:
            assert peer.read() == pending.pop(0)
        assert peer.read() is None and ring.used() == 0
    finally:
        peer.close()
        ring.close()
    ring = ByteRing.create(256)
    peer = ByteRing.attach(ring.name)
    try:
        assert ring.write(b"x" * 200) and not ring.write(b"y" * 100)  # full: refused, nothing written
        assert ring.used() == 204 and peer.read() == b"x" * 200 and peer.read() is None
    finally:
        peer.close()
        ring.close()


def test_events_and_audio_cross_the_ring_unchanged():
    pcm = np.random.default_rng(0).standard_normal(1920).astype(np.float32)
    frame = FrameOut(pcm=pcm, text=" héllo", text_token=7, tick=41, produced_at=12.5)
    stream, got, backlog = read_event(b"".join(bytes(p) for p in event_parts(3, frame, backlog=2)))
    assert (stream, backlog, got.text, got.text_token, got.tick, got.produced_at) == (3, 2, " héllo", 7, 41, 12.5)
    assert np.array_equal(got.pcm, pcm)
    stream, got, backlog = read_event(b"".join(bytes(p) for p in event_parts(4, TtsAudio(pcm))))
    assert (stream, backlog) == (4, None) and np.array_equal(got.pcm, pcm)
    stream, got, _ = read_event(b"".join(bytes(p) for p in event_parts(5, Terminal(Status.FAILED, "why"))))
    assert (stream, got.status, got.reason) == (5, Status.FAILED, "why")
    for at in (None, 3.25):
        stream, audio, received_at = read_input(b"".join(bytes(p) for p in input_parts(9, pcm, at)))
        assert (stream, received_at) == (9, at) and np.array_equal(audio, pcm)


def test_a_worker_linking_while_the_engine_dies_mid_hello_links_to_the_next_engine(tmp_path):
    """An edge worker restarted just before the engine process dies reads a closed channel in the
    middle of its hello: that is the engine's restart, not the worker's failure, so it links to the
    next engine process instead of exiting before ready (which would stop the whole server)."""
    from parley.realtime.engine_process.client import RemoteClient
    from parley.realtime.engine_process.wire import Channel

    path = str(tmp_path / "engine.sock")
    hellos: list[tuple] = []
    rings: list[ByteRing] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer)
        hellos.append(await channel.receive())
        if len(hellos) == 1:  # the first engine process dies before it answers
            writer.transport.abort()
            return
        rings.extend(ByteRing.attach(name) for name in hellos[-1][2:])  # as an engine does (rings.py rule 4)
        channel.send(("hello", "spec", 6, True, {}))
        channel.send(("status", {}, True, True, None, None))
        await channel.drain()

    async def scenario() -> None:
        server = await asyncio.start_unix_server(engine, path)
        client = RemoteClient(path, 1)
        try:
            await asyncio.wait_for(client.link(), 10)
            assert (client.edge_spec, client.max_sessions) == ("spec", 6)
        finally:
            client.close_link()
            server.close()
            for ring in rings:
                ring.close()

    asyncio.run(scenario())
    assert [h[:2] for h in hellos] == [("hello", 1), ("hello", 1)]


def test_a_burst_of_offers_goes_to_the_workers_holding_fewer_calls_counting_those_already_sent(monkeypatch):
    """calls/call_relay.py rule 5: worker 0 holds 4 calls, the others none; 4 offers arriving at
    once (each relayed answer still pending) go 2 to each other worker, not all to the first
    that looked lightest; once worker 0 holds no more than any other, it answers itself."""
    from parley.realtime.calls.call_relay import CallRelay

    counts = [4, 7, 7]  # a predecessor's count in this worker's slot is cleared
    relay = CallRelay(["w0", "w1", "w2"], 0, counts)
    assert counts[0] == 0 and relay.lighter() is None and relay.peers == ["w1", "w2"]
    releases = [relay.hold_call() for _ in range(4)]
    counts[1:] = [0, 0]
    assert counts[0] == 4
    gate, sent_to = asyncio.Event(), []

    async def post(peer, request, body, timeout):
        sent_to.append(peer)
        await gate.wait()
        return "answer"
    monkeypatch.setattr(CallRelay, "_post", staticmethod(post))

    async def burst():
        targets = []
        tasks = []
        for _ in range(4):
            target = relay.lighter()
            targets.append(target)
            tasks.append(asyncio.create_task(relay.place(None, b"offer", target)))
            await asyncio.sleep(0)  # each relay under way before the next offer is judged
        gate.set()
        return targets, await asyncio.gather(*tasks)
    targets, answers = asyncio.run(burst())
    assert sorted(targets) == [1, 1, 2, 2] and answers == ["answer"] * 4 and sorted(sent_to) == ["w1", "w1", "w2", "w2"]
    counts[1:] = [2, 2]  # the other workers now hold them, and this one still its 4
    assert relay.lighter() == 1
    releases[0](), releases[0](), releases[1]()  # a release counts once
    assert counts[0] == 2 and relay.lighter() is None  # as many as the others: answered here


def test_an_offer_no_lighter_worker_answers_is_answered_here_with_its_body_whole(monkeypatch):
    """webrtc/doors.py `_placed`: the body read for the relay reads again for this worker's own answer
    when the lighter worker cannot be reached; an answer from it is the client's as it came."""
    from starlette.requests import Request
    from starlette.responses import Response

    from parley.realtime.webrtc import doors

    class Relay:
        answer = None

        def relayed(self, request):
            return False

        def lighter(self):
            return 1

        async def place(self, request, body, target):
            self.sent = (body, target)
            return self.answer
    relay = Relay()
    monkeypatch.setattr(doors, "_relay", lambda request: relay)
    offer = b"v=0\r\n" + b"a=x\r\n" * 3000  # more than one chunk

    def request() -> Request:
        chunks = [offer[:8000], offer[8000:]]

        async def receive():
            body = chunks.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(chunks)}
        return Request({"type": "http", "method": "POST", "path": "/v1/realtime/calls", "query_string": b"",
                        "headers": [(b"content-type", b"application/sdp")]}, receive)

    async def scenario():
        again, placed = await doors._placed(request())
        assert placed is None and relay.sent == (offer, 1)
        assert await again.body() == offer
        relay.answer = Response(b"answer", 201, headers={"location": "/v1/realtime/calls/rtc_1"})
        again, placed = await doors._placed(request())
        assert placed is relay.answer
    asyncio.run(scenario())


def test_a_relayed_request_names_the_client_the_relaying_worker_passed_and_tcp_keeps_its_own():
    """calls/call_relay.py `RelayedClient`: the private socket's requests have no address of their own."""
    from parley.realtime.calls.call_relay import CLIENT, RelayedClient

    seen = []

    async def app(scope, receive, send):
        seen.append(scope.get("client"))
    middleware = RelayedClient(app)
    header = [(CLIENT.encode(), b"203.0.113.7:5123")]
    for scope in ({"type": "http", "client": None, "headers": header},  # over the private socket
                  {"type": "websocket", "client": None, "headers": header},
                  {"type": "http", "client": ("198.51.100.1", 40000), "headers": header},  # over TCP: kept
                  {"type": "http", "client": None, "headers": [(CLIENT.encode(), b"nonsense")]},
                  {"type": "lifespan"}):
        asyncio.run(middleware(scope, None, None))
    assert seen == [("203.0.113.7", 5123), ("203.0.113.7", 5123), ("198.51.100.1", 40000), None, None]


def test_one_scrape_of_every_process_reads_as_one_process():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

    from parley.realtime.http.metrics import EdgeMetrics, exposition

    def process(live: int, late: int, pause: float, delays: list[float]) -> CollectorRegistry:
        r = CollectorRegistry()
        ProcessCollector(registry=r)
        Gauge("parley_test_things", "live", registry=r).set(live)
        Counter("parley_test_late_ticks", "late", registry=r).inc(late)
        Gauge("parley_test_pause_max_seconds", "longest", registry=r).set(pause)
        h = Histogram("parley_transcript_delay_seconds", "delay", ["path"], buckets=(0.1, 1.0), registry=r)
        for d in delays:
            h.labels(path="paired").observe(d)
        return r

    engine = exposition(process(0, 3, 0.5, [0.05]).collect(), "engine")
    other = exposition(process(2, 0, 0.2, [0.5, 2.0]).collect(), "edge-1")
    mine = EdgeMetrics(process="edge-0", others=lambda: [engine, other])
    Gauge("parley_test_things", "live", registry=mine.registry).set(5)
    text = mine.render().decode()
    assert "parley_test_things 7.0" in text.splitlines()  # summed over the processes that have it
    assert "parley_test_late_ticks_total 3.0" in text.splitlines()
    assert "parley_test_pause_max_seconds 0.5" in text.splitlines()  # the longest, not a sum
    assert 'parley_transcript_delay_seconds_bucket{le="0.1",path="paired"} 1.0' in text
    assert 'parley_transcript_delay_seconds_bucket{le="1.0",path="paired"} 2.0' in text
    assert 'parley_transcript_delay_seconds_count{path="paired"} 3.0' in text
    assert 'process="' not in text.replace("parley_process_cpu_seconds_total{process=", "")
    for name in ("engine", "edge-0", "edge-1"):  # each process's own CPU stays its own
        assert f'parley_process_cpu_seconds_total{{process="{name}"}}' in text


# ---- the demo server with two edge workers ----

def owner_pid(port: int, client_port: int, pids: list[int]) -> int:
    """Which of `pids` holds the server end of the TCP connection from 127.0.0.1:client_port."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) == client_port:
            inode = fields[9]
    assert inode is not None, f"no server socket for the client port {client_port}"
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no worker in {pids} holds the connection from port {client_port}")


def udp_sockets(pids: list[int]) -> dict[int, int]:
    """How many UDP sockets each of `pids` holds: its calls' aiortc peers' (the same number a call)."""
    inodes = {line.split()[9] for path in ("/proc/net/udp", "/proc/net/udp6")
              for line in Path(path).read_text().splitlines()[1:]}
    counts = {}
    for pid in pids:
        links = []
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                links.append(os.readlink(fd))
            except OSError:
                continue  # closed meanwhile
        counts[pid] = sum(link.removeprefix("socket:[").removesuffix("]") in inodes for link in links)
    return counts


def udp_holder(pids: list[int]) -> int:
    """Which of `pids` holds UDP sockets: the worker whose aiortc peer holds the one live call."""
    holders = [pid for pid, count in udp_sockets(pids).items() if count]
    assert len(holders) == 1, f"UDP sockets in {holders} of {pids}"
    return holders[0]


def accepted_by(port: int, client_port: int, pids: list[int]) -> int:
    """owner_pid once a worker has accepted the connection (until then it waits in the backlog)."""
    for _ in range(200):
        try:
            return owner_pid(port, client_port, pids)
        except AssertionError:
            time.sleep(0.01)
    return owner_pid(port, client_port, pids)


def post_through_other(port: int, pids: list[int], holder: int, path: str) -> tuple[int, bytes]:
    """POST `path` (no body) on a connection the kernel gave a worker other than `holder`."""
    import http.client
    for _ in range(200):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.connect()
        if accepted_by(port, conn.sock.getsockname()[1], pids) == holder:
            conn.close()
            continue
        conn.request("POST", path)
        answer = conn.getresponse()
        try:
            return answer.status, answer.read()
        finally:
            conn.close()
    raise AssertionError(f"200 connections all reached worker {holder}")


def post(url: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def multipart(fields: dict[str, str], name: str, filename: str, data: bytes) -> tuple[bytes, str]:
    boundary = "parleyboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                 f'Content-Type: audio/wav\r\n\r\n'.encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


class Server:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.log = tmp / "serve.log"
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "parley.realtime.cli", "serve", "--edge-workers", "2", "--port", str(self.port),
             "--max-sessions", "6", "--drain-timeout", "5", "--device", "cpu"],
            cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT)
        self.base = f"127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"http://{self.base}{path}"

    def text(self) -> str:
        return self.log.read_text()

    def worker_pids(self) -> dict[int, int]:
        """Each worker index's newest pid."""
        return {int(i): int(pid) for i, pid in re.findall(r"edge worker (\d+) started \(pid (\d+)\)", self.text())}

    def engine_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"engine process (\d+) ready", self.text())]

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while http(self.url("/readyz"))[0] != 200:
            assert self.proc.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, "not ready:\n" + self.text()[-3000:]
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()


def test_edge_workers_serve_every_door_and_keep_faults_local(tmp_path):
    server = Server(tmp_path)
    try:
        server.wait_ready()
        asyncio.run(_scenario(server))
        # POST /admin/drain on whichever worker takes it drains the whole server: every process exits
        assert http(server.url("/admin/drain"), "POST")[0] == 202
        assert server.proc.wait(60) == 0, server.text()[-3000:]
        assert "SIGTERM: stopping the edge workers, then the engine process" in server.text()
    finally:
        server.stop()


async def _scenario(server: Server) -> None:
    # /metrics is one scrape of every process (each worker's arrive within a second)
    def every_process() -> bool:
        status, body = http(server.url("/metrics"))
        return status == 200 and all(f'parley_process_cpu_seconds_total{{process="{p}"}}' in body
                                     for p in ("engine", "edge-0", "edge-1"))
    await until(every_process, 10, "metrics from the engine and both workers")

    # the HTTP doors, through whichever worker takes the request
    status, body = post(server.url("/v1/audio/speech"), json.dumps({"input": "hello there", "voice": "alloy",
                                                                    "response_format": "pcm"}).encode(),
                        "application/json")
    assert status == 200 and len(body) > 4800, body[:300]
    import io

    import soundfile as sf
    wav = io.BytesIO()
    sf.write(wav, tone(220, 2.0), 24000, format="WAV")
    status, body = post(server.url("/v1/audio/transcriptions"),
                        *multipart({"model": "whisper-1"}, "file", "a.wav", wav.getvalue()))
    assert status == 200 and json.loads(body)["usage"]["seconds"] == pytest.approx(2.0), body[:300]

    # sessions on both workers (the kernel picks the worker for each connection)
    workers = server.worker_pids()
    # a sideband reaches its call whichever worker takes the attach (calls/call_relay.py)
    await _sideband_on_every_worker(server, list(workers.values()))
    await until(lambda: json.loads(http(server.url("/load"))[1] or "{}").get("live") == 0, 10, "the call's slot")
    await _calls_spread(server, list(workers.values()))
    await until(lambda: json.loads(http(server.url("/load"))[1] or "{}").get("live") == 0, 10, "the calls' slots")
    assert sorted(workers) == [0, 1]
    holders: list[Holder] = []
    owners: list[int] = []
    while len(holders) < 6 and len(set(owners)) < 2:
        holder = await hold(server.base)
        assert isinstance(holder, Holder), holder
        holders.append(holder)
        owners.append(owner_pid(server.port, holder.ws.local_address[1], list(workers.values())))
    assert await grows(holders)

    # a worker dies: only its sessions end, their slots free, the others go on, and it is restarted
    victim = owners[0]
    index = next(i for i, pid in workers.items() if pid == victim)
    os.kill(victim, signal.SIGKILL)
    mine = [h for h, o in zip(holders, owners) if o == victim]
    others = [h for h, o in zip(holders, owners) if o != victim]
    await until(lambda: all(h.task.done() for h in mine), 10, "the dead worker's sessions to end")
    assert await grows(others)
    await until(lambda: server.worker_pids().get(index, victim) != victim, 20, "the worker to be restarted")
    await until(lambda: json.loads(http(server.url("/load"))[1] or "{}").get("live") == len(others), 10,
                "the dead worker's slots to free")
    fresh = await hold(server.base)
    assert isinstance(fresh, Holder) and await grows([fresh, *others])

    # the engine process dies: sessions end with 1011, every door answers 503, then it comes back
    os.kill(server.engine_pids()[-1], signal.SIGKILL)
    live = [fresh, *others]
    await until(lambda: all(h.task.done() for h in live), 10, "the sessions to end")
    assert {h.ws.close_code for h in live} == {1011}, [h.ws.close_code for h in live]
    status, body = http(server.url("/readyz"))
    assert status == 503, body
    status, body = post(server.url("/v1/audio/speech"), b'{"input": "hi", "voice": "alloy"}', "application/json")
    assert status == 503 and json.loads(body)["error"]["code"] == "engine_unavailable", body
    assert hold_refused(await hold(server.base)) == 503
    await until(lambda: http(server.url("/readyz"))[0] == 200, 120, "the engine process to be back")
    assert len(server.engine_pids()) == 2
    again = await hold(server.base)
    assert isinstance(again, Holder) and await grows([again])
    await again.close()


def hold_refused(result) -> int:
    assert not isinstance(result, Holder), "a session was admitted while the engine process was gone"
    return result[0]


async def _calls_spread(server: Server, pids: list[int]) -> None:
    """Four calls through one SDK client (one kept-alive connection: one worker takes every offer)
    end up two on each worker: an offer reaching the worker holding more calls is answered by the
    other (calls/call_relay.py rule 5)."""
    from test_sideband import sdk
    from test_webrtc import ECHO_SETTINGS, Client

    client, callers, ids = sdk(server.base), [], []
    for _ in range(4):
        caller = Client()
        answer = await client.realtime.calls.create(sdp=await caller.offer(), session=ECHO_SETTINGS)
        await caller.answer(answer.text)
        callers.append(caller)
        ids.append(answer.response.headers["location"].rsplit("/", 1)[1])
    for caller in callers:
        await caller.wait(lambda c=caller: "session.created" in c.types(), "each call's session")
    counts = udp_sockets(pids)
    assert len(set(counts.values())) == 1 and min(counts.values()) > 0, counts
    for call_id in ids:  # whichever worker holds it (relayed hangups)
        await client.realtime.calls.hangup(call_id)
    for caller in callers:
        await caller.close()
    await client.close()


async def _sideband_on_every_worker(server: Server, pids: list[int]) -> None:
    """A Realtime WebRTC call on one worker; attaches (`?call_id=`) until both workers have taken
    one: each gets the session's answer to its own `session.update`, so the worker not holding the
    call relayed it to the one that does."""
    from test_sideband import sdk, upgrade_status
    from test_webrtc import ECHO_SETTINGS, Client
    from websockets.asyncio.client import connect

    caller, client = Client(), sdk(server.base)
    answer = await client.realtime.calls.create(sdp=await caller.offer(), session=ECHO_SETTINGS)
    call_id = answer.response.headers["location"].rsplit("/", 1)[1]
    await caller.answer(answer.text)
    await caller.wait(lambda: "session.created" in caller.types(), "the call's session")
    # the call end to end: the tone on its track is heard as speech, the model's audio comes back on
    # the server's track, and its peer runs in the edge worker itself (webrtc/local.py)
    await caller.wait(lambda: "input_audio_buffer.speech_started" in caller.types(), "the tone heard as speech")
    await caller.wait(lambda: "output_audio_buffer.started" in caller.types(), "a response's audio on the track")

    def played() -> bool:  # the frames the call's track played (the only session of the door now)
        sent = re.search(r'^parley_frames_out_total\{protocol="openai"\} (\S+)$', http(server.url("/metrics"))[1], re.M)
        return sent is not None and float(sent.group(1)) > 0
    await until(played, 10, "the response's frames counted as played on the call's track")
    await caller.wait(lambda: sum(map(np.size, caller.audio)) > 48000, "a second of the server's track")
    assert webrtc_worker_pids(server.proc.pid) == [], "a WebRTC worker process was started"
    takers: set[int] = set()
    for attempt in range(40):  # the kernel picks the worker: both take some within a few attaches
        async with connect(f"ws://{server.base}/v1/realtime?call_id={call_id}") as side:
            takers.add(owner_pid(server.port, side.local_address[1], pids))
            update = {"type": "session.update", "event_id": f"side-{attempt}",
                      "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}}
            await side.send(json.dumps(update))
            while (event := json.loads(await asyncio.wait_for(side.recv(), 20)))["type"] != "session.updated":
                assert event["type"] != "error", event
        if len(takers) == 2:
            break
    assert len(takers) == 2, "every attach landed on one worker"
    for _ in range(4):  # an id no worker holds: 404 from whichever takes it, the other asked once
        status, body = await upgrade_status(f"ws://{server.base}/v1/realtime?call_id=nope")
        assert status == 404 and body["error"]["code"] == "session_not_found", body
    # a hangup that lands on the worker not holding the call is relayed to the one that does
    holder = udp_holder(pids)
    status, body = await asyncio.to_thread(post_through_other, server.port, pids, holder,
                                           f"/v1/realtime/calls/{call_id}/hangup")
    assert status == 200, body
    await until(lambda: json.loads(http(server.url("/load"))[1] or "{}").get("live") == 0, 10, "the call to end")
    status, body = await asyncio.to_thread(post_through_other, server.port, pids, holder,
                                           f"/v1/realtime/calls/{call_id}/hangup")
    assert status == 404 and json.loads(body)["error"]["code"] == "call_not_found", body
    await caller.close()
    await client.close()
