"""Float8 weights under the fused swap: torchao's `Float8Tensor` (`qdata` and its `scale`)
re-quantized in place after each swap, from a pristine copy of both."""

import functools

import torch

from loraswap.adapters import kinds
from loraswap.engine.kernels.float8 import DoraRows, float8_kernel_available, requantize_into
from loraswap.engine.kernels.fused import BLOCK_K, triton_cdiv


class Fp8Weight:
    """A float8 weight (torchao's `Float8Tensor`: `qdata` and its `scale`) and a pristine
    copy of both. An adapter is fused by de-quantizing the copy, adding the deltas in
    fp32 and quantizing again with torchao's own rule, written into `qdata` and `scale` in
    place (compiled code keeps its tensors); `restore` is bitwise. With `on_host` the copy
    lives in pinned host RAM (the low-memory mode) and streams in when needed."""

    def __init__(self, weight: torch.Tensor, on_host: bool = False):
        self.qdata, self.scale = weight.qdata, weight.scale
        if on_host and self.qdata.is_cuda:
            self.pristine_qdata = torch.empty(self.qdata.shape, dtype=self.qdata.dtype, pin_memory=True)
            self.pristine_scale = torch.empty(self.scale.shape, dtype=self.scale.dtype, pin_memory=True)
            self.pristine_qdata.copy_(self.qdata)
            self.pristine_scale.copy_(self.scale)
        else:
            self.pristine_qdata, self.pristine_scale = self.qdata.clone(), self.scale.clone()
        from torchao.quantization import PerRow, PerTensor

        block = list(getattr(weight, "block_size", []))
        if block == [1, self.qdata.shape[-1]]:
            self.granularity = PerRow()
        elif block == list(self.qdata.shape):
            self.granularity = PerTensor()
        else:
            raise ValueError(f"float8 weights with {block} blocks are not supported; quantize per row or tensor")

    @staticmethod
    def holds(weight: torch.Tensor) -> bool:
        return type(weight).__name__ == "Float8Tensor" and hasattr(weight, "qdata") and hasattr(weight, "scale")

    @property
    def nbytes(self) -> int:
        return self.pristine_qdata.nbytes + self.pristine_scale.nbytes

    def restore(self) -> None:
        self.qdata.copy_(self.pristine_qdata, non_blocking=True)
        self.scale.copy_(self.pristine_scale, non_blocking=True)

    def write(self, changes: list[tuple[kinds.Layer, float]], kernel: bool = False) -> None:
        """Through `kernels/float8.py:requantize_into` where it runs (and `kernel`) and takes the
        changes (`kernel_call`), reading the float8 copy twice; else through eager fp32 ops
        (`changes`: (layer, the request's weight) in order)."""
        from torchao.quantization import Float8Tensor

        device = self.qdata.device
        qdata = self.pristine_qdata.to(device, non_blocking=True)
        scale = self.pristine_scale.to(device, non_blocking=True)
        call = kernel_call(changes, self.scale.numel() != 1, device) if kernel and self.qdata.is_contiguous() \
            and float8_kernel_available(self.qdata) else None
        if call is not None:
            requantize_into(self.qdata, self.scale, qdata, scale, *call[0], **call[1])
            return
        high = qdata.to(torch.float32) * scale.to(torch.float32)  # [rows, 1] or [1, 1]: broadcast
        for layer, blend in changes:
            if layer.plain:
                high.addmm_(layer.up.to(torch.float32), layer.down.to(torch.float32), alpha=blend * layer.scale)
            else:
                kinds.write(high, high, layer, blend)
        fresh = Float8Tensor.from_hp(high, float8_dtype=self.qdata.dtype, granularity=self.granularity)
        self.qdata.copy_(fresh.qdata)
        self.scale.copy_(fresh.scale.reshape(self.scale.shape))


def kernel_call(changes: list[tuple[kinds.Layer, float]], per_row: bool, device: torch.device) -> tuple | None:
    """`requantize_into`'s operands (positional, keywords) for these changes, or None where
    eager ops write them: plain LoRAs, one or a blend; with a scale per row also one LoHa
    (both pairs of one rank), one LoKr, or one DoRA over a plain LoRA rescaling output rows."""
    if all(layer.plain for layer, _ in changes):
        layer, blend = changes[0]
        # a rank neither 16 nor whole unrolled 32-rank blocks (8, 48, 96) is read masked, 13-25%
        # slower on an H100; padded here, at each swap, its launches and copies cost far more (82 ms, not 35)
        return ((layer.up, layer.down, blend * layer.scale) if len(changes) == 1
                else side_by_side(changes, device)), {}
    if len(changes) != 1 or not per_row:
        return None
    layer, blend = changes[0]
    if layer.dora is None and layer.kind is kinds.LOKR:  # the Kronecker factors whole, in fp32 as eager ops take them
        return (*layer.kind.kron_matrices(layer.factors, torch.float32), blend * layer.scale), {"kind": "kronecker"}
    if layer.dora is None:
        fast = layer.kind.fast_write(layer.factors)
        if fast is None or fast.kernel != "hadamard" or fast.operands[0].shape[1] != fast.operands[2].shape[1]:
            return None
        up, down, up2, down2 = fast.operands
        return (up, down, blend * layer.scale), {"kind": "hadamard", "second": (up2, down2)}
    change = layer.without_dora()
    if not change.plain or layer.dora == "lycoris-in":
        return None
    rows = DoraRows(layer.factors["magnitude"].reshape(-1), blend, layer.dora == "peft")
    return (change.up, change.down, kinds.dora_change_weight(layer, blend) * layer.scale), {"dora": rows}


def side_by_side(changes: list[tuple[kinds.Layer, float]], device: torch.device) -> tuple:
    """A blend of plain LoRAs as `requantize_into`'s (up, down, 1.0, alphas): the up factors
    side by side and the down factors stacked, each padded with zero ranks to a multiple of
    `BLOCK_K`, and each block's weight (the kernel weighs each block's product, in fp32, as
    the eager path adds each adapter's)."""
    dtype = functools.reduce(torch.promote_types, (layer.up.dtype for layer, _ in changes))
    ups, downs, alphas = [], [], []
    for layer, blend in changes:
        rank = layer.down.shape[0]
        padding = triton_cdiv(rank, BLOCK_K) * BLOCK_K - rank
        ups.append(torch.nn.functional.pad(layer.up.to(dtype), (0, padding)))
        downs.append(torch.nn.functional.pad(layer.down.to(dtype), (0, 0, 0, padding)))
        alphas += [blend * layer.scale] * ((rank + padding) // BLOCK_K)
    # from pageable memory without waiting for the stream (`torch.tensor(..., device=)` would)
    weights = torch.tensor(alphas, dtype=torch.float32).to(device, non_blocking=True)
    return torch.cat(ups, 1), torch.cat(downs, 0), 1.0, weights
