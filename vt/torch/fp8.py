"""FP8 (e4m3) linear weights for vt.torch's Llama decoder: the weights, how a bf16 or fp32
weight is quantized at load, how an FP8 checkpoint's quantization_config is read, and the
linear that computes with them.

A weight is float8_e4m3fn [N, K] with float32 scales (Fp8Weight): per output channel
(scale [N]: w[n, k] ~ q[n, k] * scale[n]) or per 128 x 128 block (scale [ceil(N / 128),
ceil(K / 128)]: w[n, k] ~ q[n, k] * scale[n // 128, k // 128]). A checkpoint's per-tensor
scale is stored per channel (every row the same value): a fused q/k/v then holds the three
tensors' scales side by side, exactly.

quantize_per_channel: scale[n] = amax(|w[n, :]|) / 448 (448 is e4m3's largest finite value),
q = w / scale rounded to nearest e4m3 (clamped to +-448 first; an all-zero row gets scale 1).

The linear (linear, linear_silu_mul; LayerOps' FP8 kind, vt.torch.llama):
  reference (the CPU and the sim): the weight dequantized to float32 (q * scale: exact for a
    per-channel scale up to one float32 rounding per element), x in float32, F.linear in
    float32, then one rounding to x's dtype, then the bias in x's dtype. silu_mul follows on
    the rounded output, as the bf16 path's does.
  CUDA, fewer than W8A8_MIN_ROWS rows (decode at small batches), or a block-scaled weight
    up to GEMV_MAX_ROWS: vt.torch.triton_fp8's kernels, which read the FP8 weight and compute
    the same function: e4m3 and bf16 widened to float32 exactly, products summed in float32
    (in its own order), the scale applied in float32 (per channel in the epilogue, per block
    on each 128-wide K tile's partial sum), one rounding to x's dtype.
  CUDA, W8A8_MIN_ROWS to GEMV_MAX_ROWS rows and a per-channel weight (decode at larger
    batches): W8A8, triton_fp8.w8a8_linear: each row of x quantized to e4m3 with its own
    scale (quantize_rows: amax / 448 of the row, dynamic), FP8 x FP8 tensor-core dots summed
    in float32, then the row's and the channel's scales, one rounding: the CPU's
    reference_scaled_linear but for the summation order. Measured on an H100 at 16-64 rows
    of the 8B shape's projections, it takes 1.2-2.2x the weight's byte time (quantize_rows
    included) where the weight-only kernel took 1.3-3.8x (docs/torch.md).
  CUDA, more rows (a step with prompt tokens): PROMPT_LINEAR picks "scaled_mm" (the default;
    torch._scaled_mm with the same per-token activation scales and the per-channel weight
    scales: FP8 tensor cores; per-block weights dequantize) or "dequantize" (the weight
    dequantized to x's dtype, then cuBLAS: a second rounding of the weight to bf16,
    activations unquantized).
  The CPU follows the same choices: from W8A8_MIN_ROWS rows (past GEMV_MAX_ROWS only with
    "scaled_mm") it quantizes the activations as CUDA does (reference_scaled_linear), so the
    sim computes what the GPU does.
Where the activations are quantized, the norm before a projection can hand them over already
quantized (Fp8Rows; add_norm_quantized: on CUDA the add, the norm and the quantization in one
kernel, triton_fp8.norm_quantize_rows), with the same values as the linear's own quantization.
Every shape follows the inputs' and nothing is read on the host: each call captures.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0      # e4m3fn's largest finite magnitude
BLOCK = 128          # the `fp8` format's weight_block_size, the only one vt reads
QUANTIZATIONS = ("fp8",)
GEMV_MAX_ROWS = 256  # the most rows vt.torch.triton_fp8 takes; more go to the prompt linear
# From this many rows a per-channel weight's linear quantizes the activations too (W8A8): on an
# H100 at the 8B shape's projections it beat the weight-only kernel at 16, 32 and 64 rows.
W8A8_MIN_ROWS = 16
PROMPT_LINEARS = ("dequantize", "scaled_mm")


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """An FP8 linear weight: data float8_e4m3fn [N, K] and its float32 scale, [N] per output
    channel or [ceil(N / 128), ceil(K / 128)] per 128 x 128 block."""
    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def per_block(self) -> bool:
        return self.scale.dim() == 2


@dataclass(frozen=True, eq=False)
class Fp8Rows:
    """Activation rows quantized for a W8A8 linear (quantize_rows' values): codes
    float8_e4m3fn [S, K], their float32 scales [S, 1], and the dtype the rows were in (the
    linear's output dtype)."""
    codes: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.codes.shape[0]


class Fp8Linear(nn.Module):
    """A linear layer of FP8 weights: buffers qweight (float8_e4m3fn [out, in]) and
    weight_scale (float32, Fp8Weight's layouts), and a bias in the activations' dtype.
    `weight` is the Fp8Weight that LayerOps' FP8 linears take where nn.Linear's tensor goes.
    Move it to a device only (.to(device)): a dtype cast (.to(dtype), .half()) would cast
    the codes and the scales too, as it casts every floating-point buffer."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, per_block: bool,
                 dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        scale = ((-(-out_features // BLOCK), -(-in_features // BLOCK)) if per_block
                 else (out_features,))
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=FP8,
                                                     device=device))
        self.register_buffer("weight_scale", torch.ones(scale, dtype=torch.float32,
                                                        device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None

    @property
    def weight(self) -> Fp8Weight:
        return Fp8Weight(self.qweight, self.weight_scale)

    def extra_repr(self) -> str:
        layout = "128x128 blocks" if self.weight_scale.dim() == 2 else "per channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8 e4m3, scales {layout}")


def check_quantization(quantization) -> str | None:
    """None or "fp8"; ValueError naming anything else."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported (supported: None, "
                         f"'fp8')")
    return quantization


# e4m3 conversions in Triton (fp8e4nv) and FP8 tensor-core dots (Triton's and
# torch._scaled_mm) need Ada or newer; vt's FP8 kernels are tested on Hopper.
MIN_CAPABILITY = (8, 9)


def check_device(what: str, device) -> None:
    """ValueError, in one line naming `what` and the GPU, where `device` is a CUDA GPU older
    than MIN_CAPABILITY; the CPU (the reference path) runs FP8 anywhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise ValueError(f"{what}: FP8 needs a GPU of compute capability "
                         f"{'.'.join(map(str, MIN_CAPABILITY))} or newer (e4m3 conversions and "
                         f"FP8 tensor cores); {torch.cuda.get_device_name(device)} is "
                         f"{capability[0]}.{capability[1]}")


def quantize_per_channel(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] (any float dtype) -> Fp8Weight with scale [N] = amax(|row|) / 448."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return Fp8Weight(to_fp8(wf / scale[:, None]), scale)


def quantize_per_tensor(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] -> Fp8Weight with one scale, amax(|w|) / 448, held per channel as vt holds a
    checkpoint's per-tensor scale (every row that value; vt quantizes per channel at load,
    this writes test checkpoints and compares schemes)."""
    wf = w.float()
    amax = wf.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return Fp8Weight(to_fp8(wf / scale), scale.expand(wf.shape[0]).contiguous())


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to nearest e4m3, clamped to +-448 first (a cast of a value past it
    is NaN on some devices)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(w: Fp8Weight, dtype=torch.float32) -> torch.Tensor:
    """[N, K] q * scale in float32, then in `dtype`."""
    q = w.data.float()
    if w.per_block:
        N, K = q.shape
        s = w.scale.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    else:
        s = w.scale[:, None]
    return (q * s).to(dtype)


def quantize_block(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] -> Fp8Weight with 128 x 128 block scales, amax / 448 of each block (the `fp8`
    format's layout; vt quantizes per channel at load, this writes test checkpoints)."""
    wf = w.float()
    N, K = wf.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    padded = F.pad(wf, (0, kb * BLOCK - K, 0, nb * BLOCK - N))
    amax = padded.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return Fp8Weight(to_fp8(wf / full), scale)


# ---- the linear -------------------------------------------------------------------------

# scaled_mm by default: at a 4,096-token prompt of the 8B shape on an H100 it takes 0.73x
# bf16's time to first token where dequantize takes 1.48x (docs/benchmarks.md).
PROMPT_LINEAR = "scaled_mm"


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, *,
           dense=F.linear, prompt_linear: str | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for an Fp8Weight (module docstring); a plain tensor weight
    (the LM head, which stays in its dtype) goes to `dense`. prompt_linear: the choice for
    more than GEMV_MAX_ROWS rows, on CUDA and the CPU alike (None: PROMPT_LINEAR)."""
    if isinstance(x, Fp8Rows):
        y = _rows_linear(x, weight)
        return y if bias is None else y + bias
    if not isinstance(weight, Fp8Weight):
        return dense(x, weight, bias)
    _check(x, weight)
    prompt_linear = prompt_linear or PROMPT_LINEAR
    if x.is_cuda:
        y = _cuda_linear(x, weight, prompt_linear)
    elif _scales_activations(x, weight, prompt_linear):
        y = reference_scaled_linear(x, weight)
    else:
        y = reference_linear(x, weight)
    return y if bias is None else y + bias


def linear_silu_mul(x: torch.Tensor, weight, bias: torch.Tensor | None = None, *,
                    dense_silu, prompt_linear: str | None = None) -> torch.Tensor:
    """silu(gate) * up of the [gate | up] projection; for an Fp8Weight at one row without bias
    on CUDA, the activation in the FP8 GEMV's epilogue (the same roundings as the two ops).
    A plain tensor weight goes to dense_silu."""
    from vt.torch import fused
    if isinstance(x, Fp8Rows):   # rows the W8A8 down projection takes quantized too
        return silu_mul_quantized(linear(x, weight, bias))
    if not isinstance(weight, Fp8Weight):
        return dense_silu(x, weight, bias)
    _check(x, weight)
    if x.is_cuda and x.shape[0] == 1 and bias is None and _triton().fits(x, weight):
        return _triton().linear_silu_mul(x, weight.data, weight.scale)
    return fused.silu_mul(linear(x, weight, bias, prompt_linear=prompt_linear))


def reference_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """The reference FP8 linear: float32 throughout, one rounding to x's dtype."""
    return F.linear(x.float(), dequantize(weight)).to(x.dtype)


def reference_scaled_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """The CPU's twin of scaled_mm_linear: x's rows quantized as quantize_rows does, the e4m3
    products summed in float32, both scales applied in float32, one rounding to x's dtype."""
    return reference_rows_linear(Fp8Rows(*quantize_rows(x), x.dtype), weight)


def reference_rows_linear(x: Fp8Rows, weight: Fp8Weight) -> torch.Tensor:
    """The CPU's W8A8 linear of rows already quantized."""
    acc = F.linear(x.codes.float(), weight.data.float())
    return (acc * x.scale * weight.scale[None, :]).to(x.dtype)


def _scales_activations(x, weight: Fp8Weight, prompt_linear: str) -> bool:
    """Whether this call quantizes x too (module docstring): a per-channel weight and
    activations_quantized(rows)."""
    return not weight.per_block and activations_quantized(x.shape[0], prompt_linear)


def activations_quantized(rows: int, prompt_linear: str | None) -> bool:
    """Whether a per-channel FP8 linear of `rows` rows quantizes its activations: from
    W8A8_MIN_ROWS rows, past GEMV_MAX_ROWS only with the scaled_mm prompt linear (None:
    PROMPT_LINEAR)."""
    prompt_linear = prompt_linear or PROMPT_LINEAR
    if prompt_linear not in PROMPT_LINEARS:
        raise ValueError(f"fp8.linear: prompt_linear={prompt_linear!r} must be one of "
                         f"{PROMPT_LINEARS}")
    if rows < W8A8_MIN_ROWS:
        return False
    return rows <= GEMV_MAX_ROWS or prompt_linear == "scaled_mm"


def _rows_linear(x: Fp8Rows, weight) -> torch.Tensor:
    """The W8A8 linear of quantized rows: the per-channel weight's kernel of linear()."""
    if not isinstance(weight, Fp8Weight) or weight.per_block:
        raise ValueError("fp8.linear: quantized activation rows (Fp8Rows) need a per-channel "
                         "FP8 weight")
    if x.codes.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8.linear: rows [S, {weight.shape[1]}] expected for weight "
                         f"{list(weight.shape)}, got {tuple(x.codes.shape)}")
    if not x.codes.is_cuda:
        return reference_rows_linear(x, weight)
    if x.rows <= GEMV_MAX_ROWS:
        return _triton().scaled_rows_linear(x.codes, x.scale, weight.data, weight.scale, x.dtype)
    return _scaled_mm(x, weight)


def add_norm_quantized(x: torch.Tensor, delta: torch.Tensor | None, norm, *, add_norm,
                       vt_kernels: bool, prompt_linear: str | None = None):
    """add_norm(x, delta, norm) (LayerOps' (x + delta, norm(x + delta))) with the normed rows
    as Fp8Rows where the per-channel projections after it quantize their activations
    (activations_quantized): on CUDA with vt's kernels one kernel
    (triton_fp8.norm_quantize_rows, the fused norm's bits), else add_norm then quantize_rows.
    Fewer rows: add_norm's pair as it is."""
    if not activations_quantized(x.shape[0], prompt_linear):
        return add_norm(x, delta, norm)
    if x.is_cuda and vt_kernels and x.dtype in (torch.bfloat16, torch.float16):
        h, codes, scale = _triton().norm_quantize_rows(x, delta, norm.weight, norm.eps)
        return (x if h is None else h), Fp8Rows(codes, scale, x.dtype)
    x, normed = add_norm(x, delta, norm)
    return x, quantized_rows(normed)


def silu_mul_quantized(gate_up: torch.Tensor) -> Fp8Rows:
    """fused.silu_mul(gate_up) quantized as quantize_rows quantizes it: on CUDA
    triton_fp8.silu_mul_quantize_rows, else the two steps."""
    from vt.torch import fused
    if gate_up.is_cuda:
        return Fp8Rows(*_triton().silu_mul_quantize_rows(gate_up), gate_up.dtype)
    return quantized_rows(fused.silu_mul(gate_up))


def _cuda_linear(x, weight: Fp8Weight, prompt_linear: str) -> torch.Tensor:
    quantized = _scales_activations(x, weight, prompt_linear)
    if _triton().fits(x, weight):
        if quantized:
            return _triton().w8a8_linear(x, weight.data, weight.scale)
        return _triton().linear(x, weight.data, weight.scale)
    if quantized:
        return scaled_mm_linear(x, weight)
    return F.linear(x, dequantize(weight, x.dtype))


def scaled_mm_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [M, K] @ weight.T on FP8 tensor cores: each row of x quantized with its own scale
    (triton_fp8.quantize_rows: quantize_rows' values, dynamic), the weight's per-channel
    scales, float32 accumulation (no fast accumulation), out in x's dtype. CUDA only (its
    CPU twin: reference_scaled_linear)."""
    return _scaled_mm(quantized_rows(x), weight)


def _scaled_mm(x: Fp8Rows, weight: Fp8Weight) -> torch.Tensor:
    return torch._scaled_mm(x.codes, weight.data.t(), scale_a=x.scale,
                            scale_b=weight.scale[None, :], out_dtype=x.dtype,
                            use_fast_accum=False)


def quantized_rows(x: torch.Tensor) -> Fp8Rows:
    """x's rows quantized (quantize_rows' values; on CUDA its Triton kernel) as Fp8Rows."""
    quantize = _triton().quantize_rows if x.is_cuda else quantize_rows
    return Fp8Rows(*quantize(x), x.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], float32 scale [M, 1]): each row's amax times 1 / 448
    in float32 (1 for an all-zero row; a product, not a quotient, because that is what CUDA's
    torch computes for a tensor over a number, and the CPU and the Triton kernel must agree
    with it bit for bit), codes = x / scale rounded to nearest e4m3 (to_fp8)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    return to_fp8(xf / scale), scale


def _check(x, weight: Fp8Weight):
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8.linear: x [S, {weight.shape[1]}] expected for weight "
                         f"{list(weight.shape)}, got {tuple(x.shape)}")


def _triton():
    from vt.torch import triton_fp8
    return triton_fp8


# ---- FP8 checkpoints ---------------------------------------------------------------------

# What each checkpoint scheme stores beside a projection's weight: the scale tensor's name and
# its shape for a weight [N, K].
SCALE_NAMES = {"channel": "weight_scale", "tensor": "weight_scale", "block": "weight_scale_inv"}


def checkpoint_scheme(qc, where: str) -> str:
    """The weight scheme of config.json's quantization_config: "channel" or "tensor"
    (compressed-tensors float8: per output channel or one scale per tensor), or "block" (the
    `fp8` format with weight_block_size [128, 128]). Anything else: a one-line ValueError
    naming the field and its value. Activation quantization (dynamic, or static input scales)
    is accepted and not used: vt's FP8 linears choose for themselves (fp8.linear: the dtype's
    activations below W8A8_MIN_ROWS rows, each token's own dynamic scale from there)."""
    if not isinstance(qc, dict):
        _refuse(where, "quantization_config", qc, "a JSON object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_scheme(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, where)
    _refuse(where, "quantization_config.quant_method", method,
            "'compressed-tensors' float8, 'fp8' with weight_block_size [128, 128]")


def _fp8_scheme(qc: dict, where: str) -> str:
    block = qc.get("weight_block_size")
    if block != [BLOCK, BLOCK]:
        _refuse(where, "quantization_config.weight_block_size", block, "[128, 128]")
    if qc.get("fmt", "e4m3") != "e4m3":
        _refuse(where, "quantization_config.fmt", qc.get("fmt"), "'e4m3'")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        _refuse(where, "quantization_config.activation_scheme", qc.get("activation_scheme"),
                "'dynamic'")
    for field in ("ignored_layers", "modules_to_not_convert"):
        _only_head_ignored(qc.get(field), f"quantization_config.{field}", where)
    return "block"


def _compressed_tensors_scheme(qc: dict, where: str) -> str:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        _refuse(where, "quantization_config.format", fmt, "'float-quantized', 'naive-quantized'")
    if qc.get("kv_cache_scheme") is not None:
        _refuse(where, "quantization_config.kv_cache_scheme", qc["kv_cache_scheme"], "null")
    # Sparse formats store other tensors than the codes (bitmasks, packed values); a dense-
    # format sparsity config stores them as they are. Transforms rotate the weights.
    sparsity = qc.get("sparsity_config")
    if sparsity is not None and not (isinstance(sparsity, dict)
                                     and sparsity.get("format") == "dense"):
        _refuse(where, "quantization_config.sparsity_config", sparsity,
                "null or format 'dense'")
    if qc.get("transform_config") is not None:
        _refuse(where, "quantization_config.transform_config", qc["transform_config"], "null")
    _only_head_ignored(qc.get("ignore"), "quantization_config.ignore", where)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        _refuse(where, "quantization_config.config_groups", groups, "one group")
    (gname, group), = groups.items()
    field = f"quantization_config.config_groups.{gname}"
    if not isinstance(group, dict):
        _refuse(where, field, group, "a JSON object")
    if group.get("targets") != ["Linear"]:
        _refuse(where, f"{field}.targets", group.get("targets"), "['Linear']")
    w = group.get("weights")
    if not isinstance(w, dict):
        _refuse(where, f"{field}.weights", w, "a float8 weight scheme")
    want = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    for key, value in want.items():
        if w.get(key) != value:
            _refuse(where, f"{field}.weights.{key}", w.get(key), repr(value))
    if w.get("group_size") is not None or w.get("block_structure") is not None:
        _refuse(where, f"{field}.weights.strategy", w.get("strategy"), "'channel', 'tensor'")
    if w.get("strategy") not in ("channel", "tensor"):
        _refuse(where, f"{field}.weights.strategy", w.get("strategy"), "'channel', 'tensor'")
    act = group.get("input_activations")
    if act is not None and not (isinstance(act, dict) and act.get("num_bits") == 8
                                and act.get("type") == "float"):
        _refuse(where, f"{field}.input_activations", act, "null or float8")
    if group.get("output_activations") is not None:
        _refuse(where, f"{field}.output_activations", group["output_activations"], "null")
    return w["strategy"]


def _only_head_ignored(ignored, field: str, where: str) -> None:
    # vt's head is never quantized; a projection left in bf16 would need a mixed layer.
    if ignored is None:
        return
    if not isinstance(ignored, list) or any(name != "lm_head" for name in ignored):
        _refuse(where, field, ignored, "null, [] or ['lm_head']")


def scale_shape(scheme: str, n: int, k: int) -> tuple[int, ...]:
    """The shape a checkpoint's scale tensor of a weight [n, k] has in `scheme` (a per-tensor
    scale may also be stored with shape [] : checkpoint_scale accepts both)."""
    return {"channel": (n, 1), "tensor": (1,),
            "block": (-(-n // BLOCK), -(-k // BLOCK))}[scheme]


def checkpoint_scale(scheme: str, scale: torch.Tensor, n: int) -> torch.Tensor:
    """A checkpoint's scale in vt's layout: [n] per channel (a per-tensor one repeated on every
    row, exactly), the block grid as it is; float32."""
    scale = scale.float()
    if scheme == "block":
        return scale
    return scale.reshape(-1).expand(n).contiguous() if scheme == "tensor" else scale.reshape(n)


def _refuse(where: str, field: str, value, supported: str):
    raise ValueError(f"{where}: {field}={value!r} is not supported (supported: {supported})")
