"""Several base models in one server: which engine serves a request.

An adapter that declares a base model (safetensors metadata, model card, adapter
config) goes to the engine hosting that model; one that declares none goes to the
default (first) model; one made for a model not hosted here is refused with 422 naming
the hosted ones. Declarations are read from the file's header and side files only;
the full read and checks happen on the chosen engine's prefetch pool.
"""

from dataclasses import dataclass, field

from safetensors import safe_open

from ..adapters.metadata import declared_base_models, refuse_other_base, same_model
from ..engine.engine import Engine
from ..engine.worker import GpuWorker
from ..errors import AdapterIncompatible, BadRequest


@dataclass
class Hosted:
    engine: Engine
    worker: GpuWorker


@dataclass
class Deployment:
    hosted: list[Hosted] = field(default_factory=list)  # the first is the default model

    @property
    def names(self) -> list[str]:
        return [h.engine.model_name for h in self.hosted]

    def by_name(self, name: str) -> Hosted | None:
        return next((h for h in self.hosted if same_model(h.engine.model_name, name)), None)

    def route(self, loras: list[tuple[str, float]], model: str | None = None) -> Hosted:
        """The engine for these adapters (and an explicitly named model, if any)."""
        if model is not None:
            hosted = self.by_name(model)
            if hosted is None:
                raise BadRequest(f"model {model!r} is not hosted here; hosted: {', '.join(self.names)}")
            chosen = hosted
        else:
            chosen = None
        default = self.hosted[0]
        for adapter_id, _ in loras:
            if len(self.hosted) == 1:  # nothing to choose: a 404 now, the full checks on prefetch
                default.engine.locate(adapter_id)
                continue
            declared = self._declared(default.engine, adapter_id)
            target = self.by_name(refuse_other_base(adapter_id, declared, self.names))
            if chosen is not None and target is not chosen and declared:
                raise AdapterIncompatible(adapter_id, f"it was made for {', '.join(declared)}, not for "
                                          f"{chosen.engine.model_name}", "Blend adapters of one base model")
            chosen = chosen or target
        return chosen or default

    @staticmethod
    def _declared(engine: Engine, adapter_id: str) -> list[str]:
        location = engine.locate(adapter_id)  # 400/403/404 for bad or unknown ids
        try:
            with safe_open(str(location.weights), "pt") as f:
                metadata = f.metadata() or {}
        except Exception:  # a broken file: the engine's full checks will say what is wrong
            metadata = {}
        return declared_base_models(metadata, location.folder)
