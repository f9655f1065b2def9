"""`GET /v1/models` and `GET /v1/models/{id}`: the served names of every modality
(server/served_models.py), in OpenAI's shape plus a `modality` field, and the 404 every door answers
for a model it does not serve.

    {"object": "list", "data": [{"id", "object": "model", "created", "owned_by": "parley", "modality"}]}
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket

from ..sessions.capacity import deny_upgrade
from .not_found import openai_error
from ..server.served_models import ModelNotFound, ServedModels
from ..server.state import app_state


def model_not_found(exc: ModelNotFound, param: str | None = "model") -> JSONResponse:
    """OpenAI's answer for a model that does not exist: 404, code model_not_found."""
    return openai_error(404, str(exc), param=param, code="model_not_found")


async def models_endpoint(request: Request) -> Response:
    """GET /v1/models."""
    models: ServedModels = app_state(request).models
    return JSONResponse(models.listing())


async def model_endpoint(request: Request) -> Response:
    """GET /v1/models/{id}: one model, or 404 model_not_found."""
    name = request.path_params["model"]
    card = app_state(request).models.card(name)
    if card is None:
        return openai_error(404, f"The model {name!r:.100} does not exist on this server (GET /v1/models lists "
                                 "every model).", param="model", code="model_not_found")
    return JSONResponse(card)


async def deny_unserved_model(websocket: WebSocket, modality: str) -> bool:
    """`?model=` in a WebSocket door's URL: a name `modality` is not served as gets the 404
    model_not_found before the upgrade (True: denied). Not given, or a modality this server
    lacks (its door then refuses the session itself, saying why): nothing to check."""
    models: ServedModels = app_state(websocket).models
    asked = websocket.query_params.get("model")
    if asked is None or modality not in models.names:
        return False
    try:
        models.resolve(modality, asked)
    except ModelNotFound as exc:
        await deny_upgrade(websocket, model_not_found(exc), "model not found")
        return True
    return False
