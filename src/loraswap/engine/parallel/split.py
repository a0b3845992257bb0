"""The split of one model over processes: diffusers' context parallelism on each denoiser,
and the checks that a model, an attention backend and a request's size can be split.

Each rank holds the whole model; diffusers splits the sequence of each attention layer over
the ranks (Ulysses: all-to-all over heads; ring: key/value blocks passed round), and with
--cfg-parallel the two guidance passes go to two halves of the ranks (`cfg.py`). What the
rank processes say to each other is `ranks.py`'s.
"""

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from loraswap.engine.config.parallelism import Parallelism, check_ring_attention
from loraswap.engine.parallel.cfg import GuidanceSplit, check_guided
from loraswap.errors import BadRequest
from loraswap.models import denoiser_names
from loraswap.models.family import Family

# families whose split sequences always divide: image tokens (checked per request; an edit's
# input image is sized by its pipeline in multiples of 32 pixels, so its tokens divide by 4),
# a text sequence padded to a fixed length, or (Qwen-Image) the prompt's own length, padded here
FAMILIES = ("flux", "flux-kontext", "flux2", "wan", "qwen-image", "qwen-image-edit")
# families whose plan splits the prompt's text: padded with masked tokens (`pad_text_to_split`),
# which ring attention cannot take (it applies each rank's own mask to every block of keys),
# nor attention backends that refuse a mask: these take one
TEXT_SPLIT = ("qwen-image", "qwen-image-edit")
MASKED_BACKENDS = (None, "native", "_native_efficient", "_native_math")


def split_model(pipeline, parallelism: Parallelism, device_type: str, model: str, attention: str | None,
                family: Family | None) -> GuidanceSplit | None:
    """Each denoiser (Wan 2.2's two experts alike) split over the ranks: its sequence, and
    with --cfg-parallel its guidance passes (their split returned; None without)."""
    denoisers = [getattr(pipeline, name) for name in denoiser_names(pipeline)]
    if parallelism.cfg > 1:
        check_guided(family, model)
    mesh = device_mesh(parallelism, device_type)
    if parallelism.sequence > 1:
        for denoiser in denoisers:
            enable_context_parallel(denoiser, mesh, model, attention, family)
    return GuidanceSplit(mesh, family, denoisers) if parallelism.cfg > 1 else None


def check_parallelizable(denoiser: torch.nn.Module, parallelism: Parallelism, model: str,
                         attention: str | None = None, family: Family | None = None) -> None:
    """Refuse a family loraswap does not split, a denoiser diffusers cannot split, a degree its
    heads do not divide by, or ring attention with a backend that cannot merge its blocks."""
    check_ring_attention(parallelism, attention)
    name = family.name if family is not None else None
    if name not in FAMILIES or getattr(type(denoiser), "_cp_plan", None) is None:
        raise ValueError(f"{model} ({name or type(denoiser).__name__}) is not split over processes: "
                         f"--ulysses-degree and --ring-degree take the {', '.join(FAMILIES)} families")
    if name in TEXT_SPLIT and parallelism.ring > 1:
        raise ValueError(f"{model} splits its prompt's text, padded with masked tokens, which ring attention does "
                         "not take: use --ulysses-degree")
    if name in TEXT_SPLIT and attention not in MASKED_BACKENDS:
        raise ValueError(f"{model} splits its prompt's text, padded with masked tokens, which --attention "
                         f"{attention} does not take: use PyTorch's default (or native, _native_efficient)")
    heads = getattr(denoiser.config, "num_attention_heads", None)
    if heads is not None and heads % parallelism.ulysses:
        raise ValueError(f"{model} has {heads} attention heads, which --ulysses-degree {parallelism.ulysses} does "
                         "not divide: choose a divisor of the head count, or use --ring-degree")


def device_mesh(parallelism: Parallelism, device_type: str) -> DeviceMesh:
    """The ranks as a mesh: `cfg` x `ring` x `ulysses` (every rank calls it, in the same order),
    on the engines' device type ("cuda": NCCL; "cpu": gloo)."""
    if not dist.is_initialized() or dist.get_world_size() != parallelism.world:
        raise RuntimeError(f"{parallelism.world} ranks need a process group of that size")
    return init_device_mesh(device_type, (parallelism.cfg, parallelism.ring, parallelism.ulysses),
                            mesh_dim_names=("cfg", "ring", "ulysses"))


def enable_context_parallel(denoiser: torch.nn.Module, mesh: DeviceMesh, model: str,
                            attention: str | None = None, family: Family | None = None) -> None:
    """Split the denoiser's sequence over the mesh's ring and ulysses dimensions (each half of
    the cfg dimension splits its own pass)."""
    from diffusers import ContextParallelConfig

    parallelism = Parallelism(mesh["ulysses"].size(), mesh["ring"].size(), mesh["cfg"].size())
    check_parallelizable(denoiser, parallelism, model, attention, family)
    config = ContextParallelConfig(ulysses_degree=parallelism.ulysses if parallelism.ulysses > 1 else None,
                                   ring_degree=parallelism.ring if parallelism.ring > 1 else None, mesh=mesh)
    with _one_device_per_cpu_rank():
        denoiser.enable_parallelism(config=config)
    if family is not None and family.name in TEXT_SPLIT:
        pad_text_to_split(denoiser, parallelism.sequence)


def pad_text_to_split(denoiser: torch.nn.Module, pieces: int) -> None:
    """The plan splits the prompt's text into `pieces`: pad it to a multiple of them with tokens
    the attention mask hides, so no image or text token attends to them. The real tokens keep
    their positions (rotary embeddings count from the first), so the image is the one unpadded.
    Every call gets a mask, padded or not, so a compiled model sees one kind of call."""

    def pad(module, args: tuple, kwargs: dict):
        text = kwargs.get("encoder_hidden_states")
        if text is None:
            return None
        extra = -text.shape[1] % pieces
        mask = kwargs.get("encoder_hidden_states_mask")
        mask = text.new_ones(text.shape[:2], dtype=torch.bool) if mask is None else mask.to(torch.bool)
        return args, dict(kwargs, encoder_hidden_states=F.pad(text, (0, 0, 0, extra)),
                          encoder_hidden_states_mask=F.pad(mask, (0, extra), value=False))

    denoiser.register_forward_pre_hook(pad, with_kwargs=True)


@contextlib.contextmanager
def _one_device_per_cpu_rank() -> Iterator[None]:
    """diffusers places rank r on device r % device_count(): 0 devices on a CPU build (a
    modulo by zero). Ranks on the CPU all share it."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield


def check_split(pipeline, family: Family | None, parallelism: Parallelism, kwargs: dict) -> None:
    """A call whose tokens (per frame; with an edit's input image's) do not split evenly over
    the ranks is refused before any rank runs it."""
    if parallelism.sequence == 1:
        return
    patch = getattr(pipeline, "vae_scale_factor", 8) * 2  # latents, then 2x2 patches
    if kwargs.get("image") is not None and family is not None and family.edit_tokens is not None:
        check_sequence(family.edit_tokens(kwargs, patch), parallelism, with_input=True)
    elif kwargs.get("width") and kwargs.get("height"):
        check_sequence((kwargs["width"] // patch) * (kwargs["height"] // patch), parallelism)


def check_sequence(tokens: int, parallelism: Parallelism, with_input: bool = False) -> None:
    """A sequence the ranks split must divide into equal pieces (a gather of unequal ones fails):
    the output's tokens, and (`with_input`) an edit's input image's beside them."""
    pieces = parallelism.sequence
    if tokens % pieces == 0:
        return
    if with_input:
        raise BadRequest(f"this size and input image make {tokens} tokens, which do not split over {pieces} ranks: "
                         f"choose an output size and input image whose tokens (width / 16 x height / 16 each) add "
                         f"up to a multiple of {pieces}")
    raise BadRequest(f"this size makes {tokens} image tokens, which do not split over {pieces} "
                     f"ranks: choose a width and height whose tokens divide by {pieces}")
