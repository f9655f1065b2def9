"""A WebRTC worker (parley.realtime.webrtc.worker) whose ICE consent checks fail within about a
second rather than 30 s, so a test sees a vanished peer's call end soon. Tests start it by
setting the pool's `argv` (tests/test_webrtc.py)."""

import sys

import aioice.ice

from parley.realtime.webrtc.worker import main

aioice.ice.CONSENT_INTERVAL = 0.2
aioice.ice.CONSENT_FAILURES = 3

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
