"""`/v1/realtime`: the OpenAI Realtime API (GA and beta dialects, transcription-only sessions)."""
