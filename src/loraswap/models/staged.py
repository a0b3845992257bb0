"""Loading a diffusers folder in two stages: build every module, then copy the weights in.

`from_pretrained` builds each model under process-wide changes: the default dtype, torch.nn.init
replaced by a no-op, parameters made on the meta device. Code running beside it that reads or
restores that state sees it half-changed; dynamo, for one, writes back the default dtype and the
random state after every frame it traces. `build_pipeline` makes all of those changes (through
diffusers' and transformers' own helpers) and undoes them; `fill_pipeline` then only copies
tensors from the safetensors files into the modules' parameters and buffers, so the engine can
compile beside it (`engine/prewarm.py`).

Only folders that come out as `from_pretrained` makes them are loaded so (tested bitwise on
the presets saved as folders): safetensors weights (one file per component, or an index of
shards), every checkpoint key a parameter or persistent buffer of the same shape, every
parameter and persistent buffer filled, no module kept in float32. Anything else raises
`Unsupported`, before any weight is copied, and the caller loads through `from_pretrained`.
"""

import importlib
import inspect
import json
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, ModelMixin
from safetensors import safe_open
from transformers import PreTrainedModel

INDEX_SUFFIX = ".safetensors.index.json"


class Unsupported(Exception):
    """This folder is not one `fill_pipeline` loads exactly as `from_pretrained` would."""


def build_pipeline(folder: str | Path, device: torch.device, dtype: torch.dtype) -> DiffusionPipeline:
    """The folder's pipeline with its modules built on `device` in `dtype`, their weights not
    yet read (`fill_pipeline` reads them); tokenizers and schedulers loaded as usual."""
    folder = Path(folder)
    index = DiffusionPipeline.load_config(folder)
    pipeline_cls = _import(index.get("_library", "diffusers"), index["_class_name"])
    components = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, (list, tuple)) or len(entry) != 2:
            continue
        library, class_name = entry
        if library is None or class_name is None:
            components[name] = None
            continue
        cls = _import(library, class_name)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            components[name] = _empty_module(cls, folder / name, device, dtype)
        else:
            components[name] = cls.from_pretrained(folder / name)
    # the pipeline's other arguments saved in the index (requires_safety_checker, say)
    accepted = inspect.signature(pipeline_cls.__init__).parameters
    options = {name: value for name, value in index.items()
               if not name.startswith("_") and name not in components and name in accepted}
    pipeline = pipeline_cls(**components, **options)
    pipeline.register_to_config(_name_or_path=str(folder))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def fill_pipeline(pipeline: DiffusionPipeline, folder: str | Path) -> None:
    """Copy every module's weights from its safetensors files (all checked first)."""
    folder = Path(folder)
    plans = [(_targets(module), _checked_files(module, folder / name, _targets(module)))
             for name, module in pipeline.components.items() if isinstance(module, torch.nn.Module)]
    with torch.no_grad():
        for targets, files in plans:
            for file, keys in files.items():
                with safe_open(file, "pt", device="cpu") as f:
                    for key in keys:
                        targets[key].copy_(f.get_tensor(key))


def _import(library: str, class_name: str):
    module = importlib.import_module(library)
    if not hasattr(module, class_name):
        raise Unsupported(f"{library} has no {class_name}")
    return getattr(module, class_name)


def _empty_module(cls: type, folder: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """`cls` built from its config on `device` in `dtype`, its parameters left uninitialized."""
    if issubclass(cls, ModelMixin):
        from diffusers.models.modeling_utils import no_init_weights

        if cls._keep_in_fp32_modules and dtype != torch.float32:
            raise Unsupported(f"{cls.__name__} keeps modules in float32")
        config = cls.load_config(folder)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device), no_init_weights():
                module = cls.from_config(config)
        finally:
            torch.set_default_dtype(previous)
    elif issubclass(cls, PreTrainedModel):
        from transformers import initialization

        kept = (cls._keep_in_fp32_modules if dtype == torch.float16 else None,
                cls._keep_in_fp32_modules_strict if dtype in (torch.float16, torch.bfloat16) else None)
        if any(kept):
            raise Unsupported(f"{cls.__name__} keeps modules in float32")
        config = cls.config_class.from_pretrained(folder)
        with torch.device(device), initialization.no_init_weights():
            module = cls._from_config(config, torch_dtype=dtype)
        module.tie_weights()  # as from_pretrained does: tied weights are one parameter, stored once
    else:
        raise Unsupported(f"{cls.__name__} is neither a diffusers nor a transformers model")
    return module.eval().requires_grad_(False)


def _targets(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by state-dict name (tied ones under each name)."""
    targets = dict(module.named_parameters(remove_duplicate=False))
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                targets[f"{prefix}.{name}" if prefix else name] = buffer
    return targets


def _checked_files(module: torch.nn.Module, folder: Path, targets: dict[str, torch.Tensor]) -> dict[Path, list[str]]:
    """file -> its keys, once every key is known to fit a target and every target is covered."""
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) > 1:
        raise Unsupported(f"{folder} has {len(indexes)} shard indexes")
    if indexes:
        names = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if len(files) != 1:
            raise Unsupported(f"{folder} has {len(files)} safetensors files (variants?), not one")
    plan, covered = {}, set()
    for file in files:
        with safe_open(file, "pt", device="cpu") as f:
            keys = list(f.keys())
            for key in keys:
                target = targets.get(key)
                if target is None or tuple(f.get_slice(key).get_shape()) != tuple(target.shape):
                    raise Unsupported(f"{file.name}: {key} is not a {type(module).__name__} weight of that shape")
                covered.add(id(target))
        plan[file] = keys
    missing = [name for name, tensor in targets.items() if id(tensor) not in covered]
    if missing:
        raise Unsupported(f"{folder.name} lacks {len(missing)} weights, e.g. {missing[0]}")
    return plan
