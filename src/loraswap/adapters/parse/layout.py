"""Where each module of an adapter file lands in the model.

A file names its modules in its trainer's layout (kohya `lora_unet_..._to_q`, SGM
`input_blocks_4_1`, BFL `double_blocks.0.img_attn.qkv`, XLabs, diffusers, PEFT, ...); the
model has diffusers module names, and some file modules are split over several model
modules (FLUX.1's fused qkv is three Linear layers in diffusers). Three ways, in order:

1. direct: the file's name is a module's name, dotted or kohya-style with `_` (SD 1.5
   and SDXL kohya and LyCORIS files in diffusers naming, T5, PEFT and diffusers files);
2. diffusers' own converters, through a probe: each file module becomes a rank-1 LoRA
   whose down weight holds the module's number and whose up weight holds its row indices;
   after `lora_state_dict` and the PEFT renaming, every model module's probe says which
   file module and which rows of it it takes. That reuses every layout diffusers reads
   (SGM renumbering, FLUX kohya, ComfyUI, XLabs, ai-toolkit, OneTrainer ...) for every
   adapter kind, not only the LoRA pairs diffusers itself loads;
3. FLUX.1's query/key norms in BFL naming, which no converter maps.

Modules none of them place are reported by the caller, naming the key.
"""

import inspect
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from diffusers.utils.state_dict_utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_peft,
    convert_unet_state_dict_to_peft,
)

_DENOISERS = ("unet", "transformer")
# file prefix -> component ("denoiser": the pipeline's unet or transformer)
_PREFIXES = (
    ("lora_unet_", "denoiser"), ("lora_transformer_", "denoiser"), ("lycoris_", "denoiser"),
    ("lora_te1_", "text_encoder"), ("lora_te2_", "text_encoder_2"), ("lora_te3_", "text_encoder_3"),
    ("lora_te_", "text_encoder"),
    ("text_encoders.clip_l.transformer.", "text_encoder"), ("text_encoders.t5xxl.transformer.", "text_encoder_2"),
    ("base_model.model.", "denoiser"), ("diffusion_model.", "denoiser"),
    ("unet.", "unet"), ("transformer.", "transformer"), ("transformer_2.", "transformer_2"),
    ("text_encoder.", "text_encoder"),
    ("text_encoder_2.", "text_encoder_2"), ("text_encoder_3.", "text_encoder_3"),
)
# FLUX.1 query/key norms, BFL name -> diffusers name (RMSNorm `scale` is diffusers' `weight`)
_FLUX_NORMS = (
    ("double_blocks.{i}.img_attn.norm.query_norm", "transformer_blocks.{i}.attn.norm_q"),
    ("double_blocks.{i}.img_attn.norm.key_norm", "transformer_blocks.{i}.attn.norm_k"),
    ("double_blocks.{i}.txt_attn.norm.query_norm", "transformer_blocks.{i}.attn.norm_added_q"),
    ("double_blocks.{i}.txt_attn.norm.key_norm", "transformer_blocks.{i}.attn.norm_added_k"),
    ("single_blocks.{i}.norm.query_norm", "single_transformer_blocks.{i}.attn.norm_q"),
    ("single_blocks.{i}.norm.key_norm", "single_transformer_blocks.{i}.attn.norm_k"),
)


@dataclass(frozen=True)
class Place:
    """A model module a file module lands on: all its rows, or the listed ones."""

    component: str
    module: str
    rows: torch.Tensor | slice | None = None  # rows of the file module's output it takes (None: all, in order)


class ModuleNames:
    """The module names of the components adapters may change, indexed for lookups."""

    def __init__(self, component_modules: dict[str, set[str]]):
        self.component_modules = component_modules
        self.fingerprint = hash(frozenset((c, frozenset(names)) for c, names in component_modules.items()))
        self.denoiser = next((c for c in _DENOISERS if c in component_modules), None)
        self._kohya: dict[str, dict[str, str | None]] = {}
        for component, names in component_modules.items():
            index: dict[str, str | None] = {}
            for name in names:
                for alias in {name.replace(".", "_"), "text_model_" + name.replace(".", "_")}:
                    index[alias] = name if index.get(alias, name) == name else None  # None: ambiguous
            self._kohya[component] = index

    def direct(self, prefix: str) -> Place | None:
        """The module a file prefix names outright, if any."""
        for start, component in _PREFIXES:
            if not prefix.startswith(start):
                continue
            component = self.denoiser if component == "denoiser" else component
            if component not in self.component_modules:
                return None
            rest = prefix.removeprefix(start)
            names = self.component_modules[component]
            for name in (rest, rest.removeprefix("text_model.")):
                if name in names:
                    return Place(component, name)
            # a trailing `_` some diffusers-to-kohya exports leave (`..._attn_to_k_.alpha`)
            name = self._kohya[component].get(rest) or self._kohya[component].get(rest.removesuffix("_"))
            return Place(component, name) if name else None
        return None

    def missing_component(self, prefix: str) -> str | None:
        """The component a file prefix names outright when this model has no such component."""
        for start, component in _PREFIXES:
            if prefix.startswith(start):
                component = self.denoiser if component == "denoiser" else component
                return component if component and component not in self.component_modules else None
        return None

    def flux_norm(self, prefix: str) -> Place | None:
        """A FLUX.1 query/key norm in BFL naming (`diffusion_model.` or kohya `lora_unet_`)."""
        if self.denoiser != "transformer":
            return None
        rest = prefix.removeprefix("diffusion_model.").removeprefix("lora_unet_")
        for bfl, diffusers_name in _FLUX_NORMS:
            head, tail = bfl.split("{i}")
            for sep in (".", "_"):
                head_s, tail_s = head.replace(".", sep), tail.replace(".", sep)
                middle = rest.removeprefix(head_s).removesuffix(tail_s)
                if rest.startswith(head_s) and rest.endswith(tail_s) and middle.isdigit():
                    name = diffusers_name.format(i=middle)
                    if name in self.component_modules["transformer"]:
                        return Place("transformer", name)
        return None


@dataclass(frozen=True)
class ProbeKeys:
    """How a file names a module's LoRA pair, so a probe looks like the file."""

    down: str  # suffix, e.g. ".lora_down.weight"
    up: str
    alpha: str | None = ".alpha"


KOHYA_PROBE = ProbeKeys(".lora_down.weight", ".lora_up.weight")
PEFT_PROBE = ProbeKeys(".lora_A.weight", ".lora_B.weight", None)


class DiffusersProbe:
    """Runs file module names through diffusers' converters (see the module docstring).

    The answer depends on names and row counts only, never on weights, and the adapters of
    one trainer for one model share their names: it is kept (`MEMO` answers) so only the
    first adapter of a layout pays for the converters."""

    MEMO = 64
    _memo: "OrderedDict[tuple, dict[str, list[Place]]]" = OrderedDict()
    _memo_lock = threading.Lock()

    def __init__(self, pipeline_cls, names: ModuleNames, unet_config=None):
        self.pipeline_cls = pipeline_cls
        self.names = names
        self.unet_config = unet_config

    def places(self, modules: dict[str, tuple[int, ProbeKeys]]) -> dict[str, list[Place]]:
        """file module prefix -> where its rows land, for `modules` (prefix -> (rows, names)).

        Raises what diffusers raises when it cannot read the names at all."""
        key = (self.pipeline_cls, self.names.fingerprint, repr(self.unet_config), tuple(modules.items()))
        with self._memo_lock:  # the store reads on several threads
            found = self._memo.get(key)
        if found is None:
            found = self._places(modules)
        with self._memo_lock:
            self._memo[key] = found
            self._memo.move_to_end(key)
            while len(self._memo) > self.MEMO:
                self._memo.popitem(last=False)
        return {prefix: list(places) for prefix, places in found.items()}

    def _places(self, modules: dict[str, tuple[int, ProbeKeys]]) -> dict[str, list[Place]]:
        prefixes = list(modules)
        probe = {}
        for number, prefix in enumerate(prefixes):
            rows, keys = modules[prefix]
            probe[prefix + keys.down] = torch.full((1, 1), float(number + 1))
            probe[prefix + keys.up] = torch.arange(rows, dtype=torch.float32).reshape(rows, 1)
            if keys.alpha:
                probe[prefix + keys.alpha] = torch.tensor(1.0)
        found: dict[str, list[Place]] = {}
        for component, pairs in self._convert(probe).items():
            for module, (down, up) in pairs.items():
                numbers = set(down.reshape(-1).tolist())  # tiny tensors: lists beat torch.unique's sort
                if len(numbers) != 1 or module not in self.names.component_modules[component]:
                    continue  # merged from several file modules, or no module of the model: not placed
                prefix = prefixes[int(numbers.pop()) - 1]
                rows = up.reshape(-1).round().long()
                whole = rows.numel() == modules[prefix][0] and _is_run(rows, 0)
                found.setdefault(prefix, []).append(Place(component, module, None if whole else _index(rows)))
        return found

    def _convert(self, probe: dict[str, torch.Tensor]) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Both of diffusers' stages: component -> module -> (lora_A, lora_B)."""
        converted = self._lora_state_dict(probe)
        out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for component, module_names in self.names.component_modules.items():
            prefix = component + "."
            sub = {k.removeprefix(prefix): v for k, v in converted.items() if k.startswith(prefix)}
            if not sub:
                continue
            renamed = peft_converter(component, module_names)(sub)
            pairs: dict[str, dict[str, torch.Tensor]] = {}
            for key, tensor in renamed.items():
                for part in ("lora_A", "lora_B"):
                    if key.endswith(f".{part}.weight"):
                        pairs.setdefault(key.removesuffix(f".{part}.weight"), {})[part] = tensor
            out[component] = {m: (p["lora_A"], p["lora_B"]) for m, p in pairs.items() if len(p) == 2}
        return out

    def _lora_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage one: diffusers' `lora_state_dict` to diffusers naming."""
        cls = self.pipeline_cls
        kwargs = {"return_alphas": True} if "return_alphas" in inspect.signature(cls.lora_state_dict).parameters \
            else {}
        if self.unet_config is not None:
            kwargs["unet_config"] = self.unet_config
        out = cls.lora_state_dict(dict(state_dict), **kwargs)
        return out if isinstance(out, dict) else out[0]


def _is_run(rows: torch.Tensor, first: int) -> bool:
    return torch.equal(rows, torch.arange(first, first + rows.numel()))


def _index(rows: torch.Tensor) -> torch.Tensor | slice:
    """Row indices, as a slice when they are one run (a view then, not a copy)."""
    first = int(rows[0]) if rows.numel() else 0
    return slice(first, first + rows.numel()) if _is_run(rows, first) else rows


def peft_converter(component: str, module_names: set[str]):
    """Stage two: component-relative keys -> PEFT keys (`<module>.lora_A.weight`)."""
    if not component.startswith("text_encoder"):
        return lambda sd: sd if any("lora_A" in k for k in sd) else convert_unet_state_dict_to_peft(sd)
    flattened = not any(name.startswith("text_model.") for name in module_names)

    def convert_text_encoder(sd):
        sd = convert_state_dict_to_peft(convert_state_dict_to_diffusers(sd))
        # transformers 5 flattens CLIPTextModel; files still say `text_model.`
        return {k.removeprefix("text_model."): v for k, v in sd.items()} if flattened else sd

    return convert_text_encoder
