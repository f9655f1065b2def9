"""What `model` means, on every door: each modality the server serves has served names.

A modality's names are its checkpoint's name first, then the operator's aliases
(`--served-model-name tts=tts-1,kyutai-tts`, vLLM's convention). A request that names another
model gets OpenAI's 404 `model_not_found`; one that leaves `model` out gets the served one.
`GET /v1/models` lists every name, with its modality (its record's key, server/modalities.py).
Torch-free: the CLI parses the flag without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .modalities import MODALITIES

# A modality: what it is (for messages) and the doors that serve it, by its one key (server/modalities.py).
WHAT = {modality.key: modality.what for modality in MODALITIES if modality.named}
OWNED_BY = "parley"


class ModelNotFound(LookupError):
    """A request named a model this modality is not served as."""

    def __init__(self, modality: str, asked: str, names: tuple[str, ...]) -> None:
        served = ", ".join(repr(n) for n in names)
        super().__init__(f"the model {asked!r:.100} does not exist on this server: its {WHAT[modality]} "
                         f"is served as {served} (GET /v1/models lists every model); leave model out to use it.")


def parse_served_names(values: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """`--served-model-name MODALITY=NAME[,NAME...]`, repeatable; a ValueError names the mistake."""
    aliases: dict[str, tuple[str, ...]] = {}
    for value in values:
        modality, sep, names = value.partition("=")
        modality = modality.strip()
        if not sep or modality not in WHAT:
            raise ValueError(f"--served-model-name {value!r}: expected MODALITY=NAME[,NAME...] with MODALITY one "
                             f"of {', '.join(WHAT)}")
        listed = tuple(n.strip() for n in names.split(","))
        if not all(listed):
            raise ValueError(f"--served-model-name {value!r}: a name is empty")
        aliases[modality] = aliases.get(modality, ()) + listed
    return aliases


@dataclass(frozen=True)
class ServedModels:
    """Each served modality's names, the checkpoint's first. `created`: the server's start (unix s)."""

    names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    created: int = 0

    @classmethod
    def build(cls, checkpoints: dict[str, str | None], aliases: dict[str, tuple[str, ...]],
              created: int = 0) -> "ServedModels":
        """`checkpoints`: each modality's checkpoint name, None where it is not served. A ValueError
        for aliases of a modality not served, or one name given to two modalities."""
        names: dict[str, tuple[str, ...]] = {}
        for modality, checkpoint in checkpoints.items():
            if checkpoint is not None:
                names[modality] = tuple(dict.fromkeys((checkpoint, *aliases.get(modality, ()))))
        for modality in aliases:
            if modality not in names:
                raise ValueError(f"--served-model-name {modality}=...: this server serves no "
                                 f"{WHAT[modality]}")
        owner: dict[str, str] = {}
        for modality, listed in names.items():
            for name in listed:
                if owner.setdefault(name, modality) != modality:
                    raise ValueError(f"the model name {name!r} is served for both {owner[name]} and {modality}: "
                                     "give them distinct names (--served-model-name)")
        return cls(names, created)

    def of(self, modality: str) -> tuple[str, ...]:
        """`modality`'s served names; () where it is not served."""
        return self.names.get(modality, ())

    def resolve(self, modality: str, asked: str | None) -> str:
        """The served name a request gets: `asked` when it is one of the modality's, its first when
        None; ModelNotFound otherwise."""
        names = self.names[modality]
        if asked is None:
            return names[0]
        if asked not in names:
            raise ModelNotFound(modality, asked, names)
        return asked

    def card(self, name: str) -> dict | None:
        """OpenAI's model object (plus `modality`), or None for a name this server does not serve."""
        for modality, listed in self.names.items():
            if name in listed:
                return {"id": name, "object": "model", "created": self.created, "owned_by": OWNED_BY,
                        "modality": modality}
        return None

    def listing(self) -> dict:
        """GET /v1/models's body."""
        return {"object": "list", "data": [self.card(n) for listed in self.names.values() for n in listed]}
