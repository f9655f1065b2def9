"""`/api/chat`: the Moshi / PersonaPlex binary WebSocket protocol."""
