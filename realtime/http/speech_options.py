"""The TTS options' bounds and defaults, torch-free: `parley tts --help` shows them without
loading a model stack (http/speech.py and server/speech_setup.py use them when serving)."""

SPEED_MIN, SPEED_MAX = 0.5, 2.0  # the range tests/test_speech_api.py checks on the model's speech rate
DEFAULT_VOICES = "kyutai/tts-voices"  # the voice set of --tts-model / parley tts when none is given
