"""Audio on the wire: Ogg-Opus (in worker processes or threads), PCM formats, speech encoders."""
