"""Loading a diffusers folder in two stages: build every module, then copy the weights in.

`from_pretrained` builds each model under process-wide changes: the default dtype, torch.nn.init
replaced by a no-op, parameters made on the meta device. Code running beside it that reads or
restores that state sees it half-changed; dynamo, for one, writes back the default dtype and the
random state after every frame it traces. `build_pipeline` makes all of those changes (through
diffusers' and transformers' own helpers) and undoes them; `plan_fill` checks every file from
its header; `fill_pipeline` then only copies tensors from the safetensors files into the
modules' parameters and buffers, so the engine can compile beside it (`engine/startup/prewarm.py`).

Only folders that come out as `from_pretrained` makes them are loaded so (tested bitwise on
the presets saved as folders, one file and sharded): diffusers and transformers classes; the
plain safetensors file of each module or the shards its index names; every checkpoint key a
parameter or persistent buffer of the same shape and every one of those filled; every
floating parameter in the wanted dtype, none kept in float32, no floating buffer computed at
build time. Anything else raises `Unsupported` from `build_pipeline` or `plan_fill`, before
any weight is copied, and the caller loads through `from_pretrained`.
"""

import contextlib
import importlib
import inspect
import json
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, ModelMixin
from safetensors import safe_open
from transformers import PreTrainedModel

from loraswap.models.architectures import default_dtype_set_to

INDEX_SUFFIX = ".safetensors.index.json"


class Unsupported(Exception):
    """This folder is not one `fill_pipeline` loads exactly as `from_pretrained` would."""


LIBRARIES = ("diffusers", "transformers")  # where the index may name a component's class
WEIGHTS = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}


def build_pipeline(folder: str | Path, device: torch.device, dtype: torch.dtype) -> DiffusionPipeline:
    """The folder's pipeline with its modules built on `device` in `dtype`, their weights not
    yet read (`plan_fill`, then `fill_pipeline`); tokenizers and schedulers loaded as usual."""
    name_or_path, folder = str(folder), Path(folder)
    index = DiffusionPipeline.load_config(folder)
    pipeline_cls = _import("diffusers", index.get("_class_name", ""))
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
            components[name] = _empty_module(cls, library, folder / name, device, dtype)
        else:
            components[name] = cls.from_pretrained(folder / name)
    # the pipeline's other arguments saved in the index (requires_safety_checker, say)
    accepted = inspect.signature(pipeline_cls.__init__).parameters
    options = {name: value for name, value in index.items()
               if not name.startswith("_") and name not in components and name in accepted}
    pipeline = pipeline_cls(**components, **options)
    pipeline.register_to_config(_name_or_path=name_or_path)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


Plan = list[tuple[dict[str, torch.Tensor], dict[Path, list[str]]]]  # per module: targets, file -> keys


def plan_fill(pipeline: DiffusionPipeline, folder: str | Path) -> Plan:
    """What `fill_pipeline` will copy, once every file of every module has been checked
    (from the safetensors headers alone); `Unsupported` otherwise."""
    folder = Path(folder)
    plan = []
    for name, module in pipeline.components.items():
        if isinstance(module, torch.nn.Module):
            # every parameter and persistent buffer by state-dict name, tied ones under each name
            targets = module.state_dict(keep_vars=True)
            plan.append((targets, _checked_files(module, folder / name, targets)))
    return plan


def fill_pipeline(plan: Plan) -> None:
    """Copy the planned tensors from the safetensors files into the modules: tensor copies only.

    Copies to a GPU go on a stream of their own and in pieces of `COPY_BYTES`, so that work
    beside the load (the stand-in's kernels, and Inductor's benchmarks of them, which
    synchronize the whole device) never queues behind a whole weight read from the disk; each
    piece returns once its source has been read, as a copy on the default stream does."""
    with torch.no_grad():
        for targets, files in plan:
            device = next((t.device for t in targets.values() if t.device.type == "cuda"), None)
            with torch.cuda.stream(torch.cuda.Stream(device)) if device else contextlib.nullcontext():
                for file, keys in files.items():
                    with safe_open(file, "pt", device="cpu") as f:
                        for key in keys:
                            _copy(targets[key], f.get_tensor(key))


COPY_BYTES = 16 * 2**20  # about a millisecond of a host-to-GPU copy from the page cache


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    if not target.is_contiguous() or target.nbytes <= COPY_BYTES:
        target.copy_(source)
        return
    into, source = target.view(-1), source.reshape(-1)  # shapes checked equal by plan_fill
    step = COPY_BYTES // target.element_size()
    for start in range(0, into.numel(), step):
        into[start:start + step].copy_(source[start:start + step])


def _import(library: str, class_name: str):
    if library not in LIBRARIES:  # a pipeline module's own class (SD 1.5's safety checker, say)
        raise Unsupported(f"{library}.{class_name} is not a diffusers or transformers class")
    module = importlib.import_module(library)
    if not class_name or not hasattr(module, class_name):
        raise Unsupported(f"{library} has no {class_name!r}")
    return getattr(module, class_name)


def _empty_module(cls: type, library: str, folder: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """`cls` built from its config on `device` in `dtype`, its parameters left uninitialized;
    `Unsupported` when `from_pretrained` would keep some of it in another dtype."""
    if library == "diffusers" and issubclass(cls, ModelMixin):
        from diffusers.models.modeling_utils import no_init_weights

        config = cls.load_config(folder)
        with default_dtype_set_to(dtype), torch.device(device), no_init_weights():
            module = cls.from_config(config)
        module.register_to_config(_name_or_path=str(folder))
        kept = module._keep_in_fp32_modules if dtype != torch.float32 else None
    elif library == "transformers" and issubclass(cls, PreTrainedModel):
        from transformers import initialization

        config = cls.config_class.from_pretrained(folder)
        with torch.device(device), initialization.no_init_weights():
            module = cls._from_config(config, dtype=dtype)
        module.tie_weights()  # as from_pretrained does: tied weights are one parameter, stored once
        module.config._name_or_path = str(folder)
        # the instance's sets, which gather its submodels' (post_init)
        kept = (getattr(module, "_keep_in_fp32_modules", None) if dtype == torch.float16 else None) or (
            getattr(module, "_keep_in_fp32_modules_strict", None) if dtype in (torch.float16, torch.bfloat16)
            else None)
    else:
        raise Unsupported(f"{cls.__name__} is neither a diffusers nor a transformers model")
    if kept:
        raise Unsupported(f"{cls.__name__} keeps {sorted(kept)} in float32")
    other = [n for n, p in module.named_parameters() if p.is_floating_point() and p.dtype != dtype]
    if other:
        raise Unsupported(f"{cls.__name__} builds {other[0]} in another dtype")
    computed = [f"{prefix}.{n}" for prefix, sub in module.named_modules() for n, b in sub._buffers.items()
                if b is not None and b.is_floating_point() and n in sub._non_persistent_buffers_set]
    if computed:  # computed where it is built: from_pretrained may compute it elsewhere
        raise Unsupported(f"{cls.__name__} computes the float buffer {computed[0]} at build time")
    return module.eval().requires_grad_(False)


def _checked_files(module: torch.nn.Module, folder: Path, targets: dict[str, torch.Tensor]) -> dict[Path, list[str]]:
    """file -> its keys, once every key is known to fit a target and every target is covered.
    The files are those `from_pretrained` reads without a variant: the plain weights file,
    or the shards its index names."""
    single = folder / WEIGHTS["diffusers" if isinstance(module, ModelMixin) else "transformers"]
    index = single.with_name(single.name.removesuffix(".safetensors") + INDEX_SUFFIX)
    if single.is_file() == index.is_file():
        raise Unsupported(f"{folder} has {'both' if single.is_file() else 'neither'} {single.name} and {index.name}")
    if index.is_file():
        files = [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = [single]
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
