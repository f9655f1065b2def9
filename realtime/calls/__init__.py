"""What both OpenAI doors (Realtime and GPT-Live) share: the transport, events in and out, audio in and out."""
