"""Does cuDNN's float8 attention (forward, inference) beat bf16 SDPA at the joint-attention shapes
of FLUX.1-dev, FLUX.2 [dev] and Wan 2.1 14B (480p), and how accurate is it? Every output is
compared with a float64 reference (computed per head and query chunk): relative error
|out - ref| / |ref| and the largest absolute error. Times are medians of
triton.testing.do_bench, over 3 interleaved rounds.

Rows: bf16 `scaled_dot_product_attention` (PyTorch's choice, forced cuDNN, forced flash), on
[B, H, S, D] views of [B, S, H, D] tensors as diffusers passes them; cuDNN float8 through the
cudnn-frontend graph API (`pygraph.sdpa_fp8`), with per-tensor e4m3 scales (amax / 448) for q,
k, v, for two layouts (the diffusers strides and contiguous BHSD), timed as the kernel alone and
with the quantization of q, k, v and the dequantization of O (eager torch, and torch.compile'd);
and bf16 SDPA on the float8-rounded q, k, v, which separates the input rounding from the rest.
On Hopper cuDNN writes O in float8 only (bf16 O needs Blackwell and cuDNN >= 9.13), so O has its
own scale (scale_o = 0.5 / descale_v: |O| <= amax(v), with a 2x margin) and is dequantized after.
P is quantized with scale_s = 448, the bound cudnn-frontend documents for E4M3 without dropout.

    pip install --no-deps --target /tmp/site nvidia_cudnn_frontend-1.32.0-cp312-...whl
    PYTHONPATH=/tmp/site:src python scripts/fp8_attention_probe.py --out $OUT/fp8-attention.json

(cudnn-frontend finds libcudnn in the site-packages of the interpreter, where torch's
nvidia-cudnn wheel put it; `import torch` comes first so both use one library.)
"""

import argparse
import json
import math
import statistics
import traceback

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

FP8_MAX = 448.0
SCALE_NAMES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
# (name, heads, sequence, head dim, gain on q and k: 2 makes the softmax peakier)
SHAPES = [
    ("flux1-dev", 24, 4608, 128, 1.0),
    ("flux1-dev, q and k x2", 24, 4608, 128, 2.0),
    ("flux2-dev", 48, 4608, 128, 1.0),
    ("wan2.1-14b 480p", 40, 32768, 128, 1.0),
]


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def reference(q, k, v, scale: float, chunk: int = 4096) -> torch.Tensor:
    """float64 attention of [1, S, H, D] tensors, one head and `chunk` queries at a time."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for h in range(q.shape[2]):
        kh, vh = k[0, :, h].double(), v[0, :, h].double()
        for s in range(0, q.shape[1], chunk):
            p = torch.softmax((q[0, s:s + chunk, h].double() @ kh.T) * scale, dim=-1)
            out[0, s:s + chunk, h] = p @ vh
    return out


def errors(out_bshd: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out_bshd.double() - ref
    return {"rel_err": float(diff.norm() / ref.norm()), "max_abs_err": float(diff.abs().max())}


def quantize(x: torch.Tensor):
    """Per-tensor e4m3: (x8, descale) with x ~= x8 * descale; descale is a [1, 1, 1, 1] fp32 GPU tensor."""
    amax = x.abs().amax().float().clamp(min=1e-12)
    x8 = (x.float() * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x8, (amax / FP8_MAX).reshape(1, 1, 1, 1)


def dequantize(o8: torch.Tensor, descale_o: torch.Tensor) -> torch.Tensor:
    return (o8.float() * descale_o).to(torch.bfloat16)


def sdpa_rows(q, k, v, scale: float) -> dict:
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views, as diffusers passes them

    def call_with(backend):
        def call():
            if backend is None:
                return F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        return call

    backends = {"bf16 sdpa (torch picks)": None, "bf16 sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
                "bf16 sdpa flash": SDPBackend.FLASH_ATTENTION}
    return {name: (lambda name=name, b=b: ({name: call_with(b)}, call_with(b)().transpose(1, 2), {}))
            for name, b in backends.items()}


def build_fp8_graph(cudnn, handle, dim, stride, scale: float, stats_kwarg: dict):
    """The cuDNN graph: q, k, v, O in e4m3 with `dim` / `stride`; scalar fp32 (de)scales; amax outputs."""
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    q, k, v = (graph.tensor(name=n, dim=dim, stride=stride, data_type=e4m3) for n in "qkv")
    scalars = {n: graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32) for n in SCALE_NAMES}
    o, _, amax_s, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, **scalars, attn_scale=scale, use_causal_mask=False,
                                          name="sdpa_fp8", **stats_kwarg)
    o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(e4m3)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, [q, k, v, *scalars.values(), o, amax_s, amax_o]


def fp8_rows(cudnn, handle, q, k, v, scale: float, layout: str, quantizers: dict) -> dict:
    """The cuDNN float8 rows for one layout: 'bshd' (diffusers' strides) or 'bhsd' (contiguous)."""
    bshd = layout == "bshd"
    stored = [x if bshd else x.transpose(1, 2).contiguous() for x in (q, k, v)]

    def as_bhsd(x):
        return x.transpose(1, 2) if bshd else x

    def make():
        (q8, dq), (k8, dk), (v8, dv) = (quantize(x) for x in stored)
        view = as_bhsd(q8)
        graph = None
        for stats_kwarg in ({"generate_stats": False}, {"is_inference": True}):  # the newer spelling first
            try:
                graph, ports = build_fp8_graph(cudnn, handle, list(view.shape), list(view.stride()), scale, stats_kwarg)
                break
            except TypeError as e:  # pybind's "incompatible function arguments": try the other spelling
                print(f"sdpa_fp8 with {stats_kwarg}: {str(e)[:200]}")
        if graph is None:
            raise RuntimeError("sdpa_fp8 took neither generate_stats nor is_inference")
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device="cuda")
        const = [torch.full((1, 1, 1, 1), x, dtype=torch.float32, device="cuda") for x in (1 / FP8_MAX, FP8_MAX)]
        o8, amax_s, amax_o = torch.empty_like(q8), torch.zeros_like(dq), torch.zeros_like(dq)

        def run(q8, dq, k8, dk, v8, dv, scale_o):  # O in e4m3, scaled by scale_o = 0.5 / descale_v
            buffers = [as_bhsd(q8), as_bhsd(k8), as_bhsd(v8), dq, dk, dv, *const, scale_o, as_bhsd(o8), amax_s, amax_o]
            graph.execute(dict(zip(ports, buffers)), workspace, handle=handle)
            return o8

        def pipeline(quant, dequant):  # bf16 q, k, v in, bf16 O out
            q8, dq, k8, dk, v8, dv = (t for x in stored for t in quant(x))
            return dequant(run(q8, dq, k8, dk, v8, dv, 0.5 / dv), 2 * dv)

        scale_o = 0.5 / dv
        out = dequantize(run(q8, dq, k8, dk, v8, dv, scale_o), 2 * dv)
        torch.cuda.synchronize()
        info = {"amax_s": float(amax_s), "amax_o": float(amax_o), "amax_v": float(dv * FP8_MAX),
                "plans": graph.get_execution_plan_count()}
        calls = {f"cudnn fp8 {layout} kernel only": lambda: run(q8, dq, k8, dk, v8, dv, scale_o)}
        for name, (quant, dequant) in quantizers.items():
            calls[f"cudnn fp8 {layout} + quant, dequant ({name})"] = lambda q=quant, d=dequant: pipeline(q, d)
        return calls, (out if bshd else out.transpose(1, 2)), info

    return {f"cudnn fp8 {layout}": make}


def rounded_inputs_row(q, k, v, scale: float) -> dict:
    def make():
        qt, kt, vt = ((x8.float() * d).to(torch.bfloat16).transpose(1, 2) for x8, d in (quantize(x) for x in (q, k, v)))
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        return {}, out.transpose(1, 2), {"note": "accuracy only: bf16 sdpa on float8-rounded q, k, v"}
    return {"bf16 sdpa on fp8-rounded qkv": make}


def probe_shape(heads: int, seq: int, dim: int, gain: float, cudnn, handle, quantizers: dict) -> dict:
    q, k, v = (torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q, k = q * gain, k * gain
    scale = 1 / math.sqrt(dim)
    ref = reference(q, k, v, scale)
    makers = {**sdpa_rows(q, k, v, scale), **rounded_inputs_row(q, k, v, scale)}
    if cudnn is not None:
        for layout in ("bshd", "bhsd"):
            makers.update(fp8_rows(cudnn, handle, q, k, v, scale, layout, quantizers))
    rows, calls = {}, {}
    for name, make in makers.items():  # each variant on its own: one failure does not stop the others
        try:
            variant_calls, out, info = make()
            torch.cuda.synchronize()
            rows[name] = {**errors(out, ref), **info}
            calls.update(variant_calls)
        except Exception as e:  # noqa: BLE001 - a backend, layout or API this build cannot run
            traceback.print_exc()
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    times = {name: [] for name in calls}
    for _ in range(3):  # interleaved rounds, so drift hits every variant alike
        for name, call in calls.items():
            try:
                times[name].append(bench(call))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.setdefault(name, {})["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    for name, ms in times.items():
        if ms:
            rows.setdefault(name, {})["ms"] = round(statistics.median(ms), 4)
    return rows


def load_cudnn_frontend():
    try:
        import cudnn

        handle = cudnn.create_handle()
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
        return cudnn, handle, {"frontend": cudnn.__version__, "backend": cudnn.backend_version()}
    except Exception as e:  # noqa: BLE001 - not installed, or no libcudnn it can load
        traceback.print_exc()
        return None, None, {"error": f"{type(e).__name__}: {str(e)[:400]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd quantization timing")
    parser.add_argument("--shapes", default="all", help="'all', or a comma list of indices into SHAPES")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    cudnn, handle, cudnn_info = load_cudnn_frontend()
    quantizers = {"eager": (quantize, dequantize)}
    if not args.no_compile:  # one kernel for the scale and cast of each tensor instead of four
        quantizers["compiled"] = (torch.compile(quantize), torch.compile(dequantize))
    report = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
              "torch": torch.__version__, "torch_cudnn": torch.backends.cudnn.version(), "cudnn_frontend": cudnn_info,
              "shapes": {}}
    print(json.dumps({k: v for k, v in report.items() if k != "shapes"}), flush=True)
    picked = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    for name, heads, seq, dim, gain in picked:
        rows = probe_shape(heads, seq, dim, gain, cudnn, handle, quantizers)
        report["shapes"][name] = {"batch": 1, "heads": heads, "seq": seq, "head_dim": dim, "qk_gain": gain,
                                  "rows": rows}
        print(f"\n{name}: B=1 H={heads} S={seq} D={dim} q,k gain {gain}")
        print(f"{'variant':44} {'ms':>9} {'rel err':>10} {'max abs':>10}")
        for variant, row in rows.items():
            if "error" in row and "ms" not in row:
                print(f"{variant:44} ERROR {row['error'][:120]}")
                continue
            print(f"{variant:44} {row.get('ms', float('nan')):9.4f} {row.get('rel_err', float('nan')):10.2e} "
                  f"{row.get('max_abs_err', float('nan')):10.2e}", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
