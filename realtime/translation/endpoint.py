"""`/v1/realtime/translations`' WebSocket route: the model check, admission, then the connection.

- `?model=` (the openai SDK always sends one) must be one of the translating model's served names
  (model.py's `Translator.modality`, server/served_models.py): another is OpenAI's 404
  `model_not_found` before the upgrade. Left out, the session's label is the first served name.
- Keys and Origins are checked before this runs (server/security.py); a full or draining server
  answers the upgrade with 503 + Retry-After (sessions/capacity.py), as on every door. A session
  holds one duplex slot.
"""

from __future__ import annotations

from starlette.websockets import WebSocket

from .connection import PROTOCOL, TranslationConnection
from .model import served_translator
from ..http.models import deny_unserved_model
from ..server.state import app_state


async def translation_endpoint(websocket: WebSocket) -> None:
    manager = app_state(websocket).sessions
    translator = served_translator(app_state(websocket))
    if await deny_unserved_model(websocket, translator.modality):
        return
    reservation = await manager.admission.reserve_or_deny(websocket, needs_slot=True)
    if reservation is None:
        return
    served = manager.models.of(translator.modality)
    model = websocket.query_params.get("model") or (served[0] if served else manager.defaults.model_name)

    async def run(edge) -> None:
        connection = TranslationConnection(edge, translator, model)
        edge.notice = connection.notice
        await connection.run()
    await manager.serve_websocket(websocket, PROTOCOL, reservation, run)
