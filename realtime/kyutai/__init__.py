"""Kyutai moshi-server's doors, for Kyutai's own clients (Unmute, LiveKit's Kyutai plugin).

`asr.py` serves `/api/asr-streaming` on the STT pool's rows, `tts.py` `/api/tts_streaming` on the
TTS pool, `info.py` `/api/build_info` and `/api/modules_info`; `messages.py` holds the msgpack
messages all of them speak. Keys (`kyutai-api-key`, `?auth_id=`), Origins, limits and drain are
the server's, as for every door (server/security.py, sessions/).
"""
