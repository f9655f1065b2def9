"""One warm-up protocol for every slack source (engine/slack.py, SlackSource): `warm_up(costs)`
captures the source's graphs, seeds `costs` with what it measured and returns it. Every slack
source class defined in engine/ defines it with exactly that signature (source-specific choices,
TTS conditions or image sizes, are constructor arguments or attributes, never warm-up parameters)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import parley.engine
from parley.engine.slack import CostModel, SlackSource


def slack_source_classes() -> list[type]:
    found = []
    for info in pkgutil.iter_modules(parley.engine.__path__):
        module = importlib.import_module(f"parley.engine.{info.name}")
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, SlackSource) and cls.__module__ == module.__name__]
    return found


def test_every_slack_source_in_the_engine_has_the_one_warm_up_signature():
    classes = slack_source_classes()
    assert {c.__name__ for c in classes} >= {"SlackSource", "PrefillSource", "TtsPool", "SttPool", "ImageQueue"}
    wrong = []
    for cls in classes:
        if "warm_up" not in vars(cls):
            wrong.append(f"{cls.__name__}: no warm_up of its own")
            continue
        params = list(inspect.signature(cls.warm_up).parameters.values())
        names = [p.name for p in params]
        if names != ["self", "costs"] or any(p.default is not inspect.Parameter.empty for p in params):
            wrong.append(f"{cls.__name__}.warm_up{inspect.signature(cls.warm_up)}: not warm_up(self, costs)")
    assert not wrong, "\n".join(wrong)


def test_a_source_with_nothing_to_warm_measures_nothing():
    class Quiet(SlackSource):
        def offer(self, left_s, costs):
            return None

    costs = CostModel()
    assert Quiet().warm_up(costs) == {} and costs.estimates() == []
