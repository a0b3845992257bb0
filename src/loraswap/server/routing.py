"""Several base models in one server: which model serves a request, and one table of
adapters over all of them.

One rule for both backends (this process's engines, and Ray replicas), for generation
and for keeping and evicting:
- an adapter that declares a base model (safetensors metadata, model card, adapter
  config) goes to the engine hosting that model, and one made for a model not hosted here
  is refused with 422 naming the hosted ones;
- one that declares none goes to the hosted model of its family, as its metadata or its
  source names it (`metadata.family_hint`), else to the hosted model whose layers its
  keys and shapes fit (the first of them: the default model when several fit); one that
  fits none is refused with 422 naming the hosted ones. Where fitting cannot be checked
  (Ray's ingress holds no model), it goes to the default (first) model.
Declarations are read from the file's header and side files only; the full read and
checks happen on the chosen engine's threads. A defect of the file itself (not safetensors,
truncated, a header over its bounds) is named as it is (400), as a one-model server names
it when it reads the file, never taken for a file that fits no hosted model.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loraswap.adapters.files.formats import open_checked
from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.files.metadata import declared_base_models, family_hint, refuse_other_base, same_model
from loraswap.adapters.reference import AdapterRef
from loraswap.engine.engine import Engine
from loraswap.engine.worker import GpuWorker
from loraswap.errors import AdapterIncompatible, BadRequest


@dataclass
class Hosted:
    engine: Engine
    worker: GpuWorker


@dataclass(frozen=True)
class HostedModel:
    """What routing knows of one hosted model: its name, its family, and (where it can tell)
    whether an adapter's keys and shapes fit its layers."""

    name: str
    family: str | None = None
    fits: Callable[[AdapterLocation], bool] | None = None


def route_by_base_model(hosted: list[HostedModel], locate: Callable[[AdapterRef], AdapterLocation],
                        refs: list[AdapterRef], model: str | None = None, *, max_adapter_bytes: int) -> str:
    """The hosted model's name (the first is the default) that serves these adapters.

    `model`: a base model named explicitly (the path or OpenAI `model`), else None.
    `locate`: the adapter's file (403/404 for unknown or refused ones), e.g. `AdapterStore.locate`;
    called once per adapter.
    `max_adapter_bytes`: the largest file served (`--max-adapter-mb`), which bounds its header.
    """
    names = [h.name for h in hosted]

    def by_name(name: str) -> str | None:
        return next((n for n in names if same_model(n, name)), None)

    chosen = None
    if model is not None:
        chosen = by_name(model)
        if chosen is None:
            raise BadRequest(f"model {model!r} is not hosted here; hosted: {', '.join(names)}")
    for ref in refs:
        adapter_id = ref.adapter_id
        location = locate(ref)
        if len(names) == 1:  # nothing to choose: a 404 now, the full checks when the worker leases them
            continue
        declared, hint = _what_it_says(location, max_adapter_bytes)
        if not declared:
            chosen = chosen or _by_what_it_is(adapter_id, location, hint, hosted)
            continue
        target = by_name(refuse_other_base(adapter_id, declared, names))
        if chosen is not None and target != chosen:
            raise AdapterIncompatible(adapter_id, f"it was made for {', '.join(declared)}, not for {chosen}",
                                      "Blend adapters of one base model")
        chosen = target
    return chosen or names[0]


def _by_what_it_is(adapter_id: str, location: AdapterLocation, hint: str | None,
                   hosted: list[HostedModel]) -> str:
    """An adapter naming no base model: the hosted model of the family it names, else the first
    whose layers it fits."""
    same_family = [h.name for h in hosted if hint is not None and h.family == hint]
    if same_family:
        return same_family[0]
    if all(h.fits is None for h in hosted):
        return hosted[0].name
    fitting = [h.name for h in hosted if h.fits is not None and h.fits(location)]
    if not fitting:
        raise AdapterIncompatible(adapter_id, f"it declares no base model and its layers fit none of the hosted "
                                  f"models ({', '.join(h.name for h in hosted)})",
                                  "Send it to a server hosting its base model")
    return fitting[0]


def _what_it_says(location: AdapterLocation, max_bytes: int) -> tuple[list[str], str | None]:
    """The base models the adapter declares, and the family its metadata or source names
    (header metadata and side files; nothing else is read). The header is checked as every
    read of the file checks it: a broken file is refused here, naming its defect."""
    file = open_checked(location.weights, location.adapter_id, max_bytes)
    file.close()
    return declared_base_models(file.metadata, location.folder), family_hint(file.metadata, location.source_says)


@dataclass(frozen=True)
class Route:
    """Where a request goes: the hosted model, and its adapters' files by id as that model's own
    store found them while routing (handed on to its lease, which does not locate them again).
    Empty when another model's store found them: each model finds files through its own sources
    (its folder, its hub and download rules), so the lease of the model chosen locates them itself."""

    hosted: Hosted
    located: dict[str, AdapterLocation]


@dataclass
class Deployment:
    hosted: list[Hosted] = field(default_factory=list)  # the first is the default model

    def __post_init__(self):
        # with several models, a download one model refuses (made for another, or fitting
        # another's layers) is kept for the others; only a file's own defect deletes it
        for hosted in self.hosted:
            hosted.engine.adapters.sole_model = len(self.hosted) == 1

    @property
    def names(self) -> list[str]:
        return [h.engine.model_name for h in self.hosted]

    def by_name(self, name: str) -> Hosted | None:
        return next((h for h in self.hosted if same_model(h.engine.model_name, name)), None)

    def route(self, refs: list[AdapterRef], model: str | None = None) -> Route:
        """The engine for these adapters (and an explicitly named model, if any), and their files
        where that engine's store is the one that found them (`Route`)."""
        located: dict[str, AdapterLocation] = {}
        hosted = self.hosted[self.names.index(self._route(self._models(), refs, model, located))]
        return Route(hosted, located if hosted is self._locating else {})

    def check_video_adapters(self, refs: list[AdapterRef], video_models: list[str],
                             target: str | None = None) -> None:
        """422 for an adapter that routing (with no model named) sends to a model that makes
        images, by its declared base model, its family or its layers; with `target`, the video
        model the request goes to, for one it sends to another model. The hosted video models
        come first (`target` first of all), so an adapter that says nothing stays with them."""
        models = sorted(self._models(), key=lambda h: (h.name != target, h.name not in video_models))
        for ref in refs:
            adapter_id = ref.adapter_id
            chosen = self._route(models, [ref], None)
            if chosen not in video_models:
                raise AdapterIncompatible(adapter_id, f"it is an adapter of {chosen}, which makes images, not "
                                          "videos", f"Name a video model ({', '.join(video_models)}) or an "
                                          "adapter of one")
            if target is not None and chosen != target:
                raise AdapterIncompatible(adapter_id, f"it is an adapter of {chosen}, not of {target}",
                                          f"Name an adapter of {target}, or {chosen} as the model")

    def _models(self) -> list[HostedModel]:
        return [HostedModel(h.engine.model_name, h.engine.calls.family.name if h.engine.calls.family else None,
                            h.engine.adapters.fits) for h in self.hosted]

    @property
    def _locating(self) -> Hosted:
        """The model whose store finds the adapters' files for routing: the default one."""
        return self.hosted[0]

    def _route(self, models: list[HostedModel], refs: list[AdapterRef], model: str | None,
               located: dict[str, AdapterLocation] | None = None) -> str:
        """`route_by_base_model` over `models`; each adapter's file, as `_locating`'s store found
        it, kept in `located`."""
        store = self._locating.engine.adapters

        def locate(ref: AdapterRef) -> AdapterLocation:
            location = store.locate(ref)
            if located is not None:
                located[ref.adapter_id] = location
            return location

        return route_by_base_model(models, locate, refs, model, max_adapter_bytes=store.limits.max_adapter_bytes)


TIER_ORDER = {"disk": 0, "host": 1, "gpu": 2}


def merge_adapter_rows(rows: Iterable[tuple[str, dict]]) -> list[dict]:
    """One row per adapter from the rows of several models (or replicas), each given with the
    model it came from: the figures of the copy in the fastest tier, kept or applied where
    any copy is, and `model`, the model holding that copy (None for an adapter only on disk)."""
    merged: dict[str, dict] = {}
    for model, row in rows:
        row = {**row, "model": model if row["cached"] != "disk" else None}
        other = merged.get(row["id"])
        if other is not None:
            if TIER_ORDER[other["cached"]] >= TIER_ORDER[row["cached"]]:
                row, other = other, row  # the first of equals wins: the default model's
            row.update(kept=row["kept"] or other["kept"], applied=row["applied"] or other["applied"])
        merged[row["id"]] = row
    return [merged[adapter_id] for adapter_id in sorted(merged)]
