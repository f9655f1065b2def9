"""WebRTC: the OpenAI WebRTC doors, and the aiortc peers in worker processes."""
