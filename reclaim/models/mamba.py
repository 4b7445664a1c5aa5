"""Mamba-1 language model with HF `MambaForCausalLM` parameter names and the mamba_ssm layout.

Each block: r + out_proj(scan(silu(conv(x))) * silu(z)) with [x, z] = in_proj(RMSNorm(r)). The
recurrent state of a layer is (h [B, D_inner, N], conv tail [B, D_inner, K-1]: the last K-1
pre-conv inputs); every forward takes it in and hands it back, so a sequence can be run in chunks
(adjoint training) or one token at a time (generation) with the same code. `forward_chunk` takes
the selective-scan kernel to run (default `selective_scan`): training engines that change the scan's
backward (the truncated adjoint) pass theirs in, and the model holds no training logic.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from reclaim.models.kernels.scan import ScanFn, selective_scan
from reclaim.models.norm import RMSNorm

HF_ARCH = "MambaForCausalLM"
MAMBA_SSM_WEIGHTS = "pytorch_model.bin"
# The one key that differs between HF and mamba_ssm checkpoints.
HF_EMBED, SSM_EMBED = "backbone.embeddings.weight", "backbone.embedding.weight"


class LayerState(NamedTuple):
    """Recurrent state of one layer: SSM state h (Mamba-1 [B, D, N], Mamba-2 [B, heads, head_dim, N])
    and the conv tail [B, conv channels, K-1]."""

    h: torch.Tensor
    conv: torch.Tensor


@dataclass
class MambaConfig:
    """Shape of a Mamba-1 LM; field names are those of the HF MambaConfig."""

    vocab_size: int = 50280
    hidden_size: int = 768
    state_size: int = 16
    num_hidden_layers: int = 32
    layer_norm_epsilon: float = 1e-5
    expand: int = 2
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    residual_in_fp32: bool = True
    time_step_rank: int | str = "auto"
    time_step_scale: float = 1.0
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_init_scheme: str = "random"
    time_step_floor: float = 1e-4
    initializer_range: float = 0.1
    rescale_prenorm_residual: bool = False
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: ['silu']")
        if not (self.time_step_rank == "auto" or isinstance(self.time_step_rank, int)):
            raise ValueError(f"time_step_rank must be 'auto' or an int, got {self.time_step_rank!r}")
        if self.conv_kernel < 1:
            raise ValueError(f"conv_kernel must be >= 1, got {self.conv_kernel}")

    @property
    def intermediate_size(self) -> int:
        return int(self.expand * self.hidden_size)

    @property
    def dt_rank(self) -> int:
        r = self.time_step_rank
        return math.ceil(self.hidden_size / 16) if r == "auto" else int(r)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "MambaConfig":
        """Build from an HF config.json dict; unknown keys are kept in `extra` for the round trip."""
        d = dict(d)
        if d.get("model_type", "mamba") != "mamba":
            from reclaim.models.loading import UnsupportedModelError  # a ValueError the CLI shows in one line

            raise UnsupportedModelError(f"model_type {d['model_type']!r} is not a Mamba-1 config; expected 'mamba' "
                                        "(a decoder trains with `reclaim grpo` or `reclaim serve --learn`)")
        if "dtype" in d:
            d.setdefault("torch_dtype", d.pop("dtype"))
        names = set(cls.__dataclass_fields__) - {"extra"}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**{k: v for k, v in d.items() if k in names}, extra=extra)

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict."""
        d = asdict(self)
        extra = d.pop("extra")
        d = {**extra, **d, "model_type": "mamba", "architectures": [HF_ARCH]}
        d["intermediate_size"] = self.intermediate_size
        return d

    @classmethod
    def from_mamba_ssm(cls, d: dict[str, Any]) -> "MambaConfig":
        """Build from a mamba_ssm config.json (d_model, n_layer, ssm_cfg, ...)."""
        ssm = dict(d.get("ssm_cfg") or {})
        if ssm.pop("layer", "Mamba1") != "Mamba1":
            raise ValueError(f"ssm_cfg.layer {d['ssm_cfg']['layer']!r} is unsupported; only 'Mamba1'")
        if not d.get("rms_norm", True):
            raise ValueError("rms_norm=false (LayerNorm blocks) is unsupported; only RMSNorm")
        if d.get("d_intermediate", 0) or d.get("attn_layer_idx"):
            raise ValueError("hybrid mamba_ssm models (d_intermediate > 0 or attn_layer_idx) are unsupported")
        pad = int(d.get("pad_vocab_size_multiple", 1))
        vocab = int(d["vocab_size"])
        vocab += (pad - vocab % pad) % pad  # mamba_ssm pads the embedding to this multiple
        return cls(
            vocab_size=vocab,
            hidden_size=int(d["d_model"]),
            num_hidden_layers=int(d["n_layer"]),
            state_size=int(ssm.get("d_state", 16)),
            conv_kernel=int(ssm.get("d_conv", 4)),
            expand=int(ssm.get("expand", 2)),
            time_step_rank=ssm.get("dt_rank", "auto"),
            use_conv_bias=bool(ssm.get("conv_bias", True)),
            use_bias=bool(ssm.get("bias", False)),
            residual_in_fp32=bool(d.get("residual_in_fp32", True)),
            tie_word_embeddings=bool(d.get("tie_embeddings", True)),
            layer_norm_epsilon=float(d.get("norm_epsilon", 1e-5)),
        )

    def to_mamba_ssm(self) -> dict[str, Any]:
        """The mamba_ssm config.json dict (vocab already padded, so pad multiple 1)."""
        return {
            "d_model": self.hidden_size,
            "n_layer": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "ssm_cfg": {
                "layer": "Mamba1",
                "d_state": self.state_size,
                "d_conv": self.conv_kernel,
                "expand": self.expand,
                "dt_rank": self.time_step_rank,
                "conv_bias": self.use_conv_bias,
                "bias": self.use_bias,
            },
            "rms_norm": True,
            "norm_epsilon": self.layer_norm_epsilon,
            "residual_in_fp32": self.residual_in_fp32,
            "fused_add_norm": True,
            "pad_vocab_size_multiple": 1,
            "tie_embeddings": self.tie_word_embeddings,
        }


def hf_to_mamba_ssm_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state dict -> mamba_ssm names (only the embedding differs)."""
    return {SSM_EMBED if k == HF_EMBED else k: v for k, v in state.items()}


def mamba_ssm_to_hf_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """mamba_ssm state dict -> HF names."""
    return {HF_EMBED if k == SSM_EMBED else k: v for k, v in state.items()}


def causal_conv(conv1d: nn.Conv1d, x: torch.Tensor, conv0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of x [B, T, D] after the tail conv0 [B, D, K-1]: (out, new tail)."""
    t, kernel = x.shape[1], conv1d.kernel_size[0]
    xc = torch.cat([conv0.to(x.dtype).transpose(1, 2), x], dim=1)  # [B, K-1+T, D]
    # A copy, not a view: a view would keep this whole chunk's input alive with the state.
    conv1 = xc[:, xc.shape[1] - (kernel - 1) :].transpose(1, 2).clone()
    # K shifted multiply-adds: far faster on CPU than grouped conv1d.
    w = conv1d.weight[:, 0]  # [D, K]
    out = xc[:, :t] * w[:, 0]
    for k in range(1, kernel):
        out = torch.addcmul(out, xc[:, k : k + t], w[:, k])
    if conv1d.bias is not None:
        out = out + conv1d.bias
    return out, conv1


class MambaMixer(nn.Module):
    """The selective-SSM mixer of one layer (HF MambaMixer parameters)."""

    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        h, d, n, r, k = cfg.hidden_size, cfg.intermediate_size, cfg.state_size, cfg.dt_rank, cfg.conv_kernel
        self.d_inner, self.n_state, self.kernel = d, n, k
        self.in_proj = nn.Linear(h, 2 * d, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(d, d, k, groups=d, padding=k - 1, bias=cfg.use_conv_bias)
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, d, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(d, 1))
        self.D = nn.Parameter(torch.ones(d))
        self.out_proj = nn.Linear(d, h, bias=cfg.use_bias)
        self._init_dt(cfg)

    @torch.no_grad()
    def _init_dt(self, cfg: MambaConfig) -> None:
        # Mamba's init: dt = softplus(bias) log-uniform in [time_step_min, time_step_max].
        std = cfg.dt_rank**-0.5 * cfg.time_step_scale
        if cfg.time_step_init_scheme == "constant":
            self.dt_proj.weight.fill_(std)
        else:
            self.dt_proj.weight.uniform_(-std, std)
        lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
        dt = torch.exp(torch.rand(self.d_inner) * (hi - lo) + lo).clamp(min=cfg.time_step_floor)
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def zero_state(self, batch: int, like: torch.Tensor) -> LayerState:
        """The state every sequence starts from."""
        dtype = torch.promote_types(like.dtype, torch.float32)
        return LayerState(
            like.new_zeros(batch, self.d_inner, self.n_state, dtype=dtype),
            like.new_zeros(batch, self.d_inner, self.kernel - 1),
        )

    def forward_chunk(
        self, u: torch.Tensor, h0: torch.Tensor, conv0: torch.Tensor, *, scan: ScanFn = selective_scan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mix normed input u [B, T, H] from state (h0, conv0); returns (out, h1, conv1).

        scan: the kernel, called as scan(x, dt, A, B, C, h0) -> (y, h1).
        """
        x, z = self.in_proj(u).chunk(2, dim=-1)
        x, conv1 = causal_conv(self.conv1d, x, conv0)
        x = F.silu(x)
        dt, B, C = self.x_proj(x).split([self.dt_proj.in_features, self.n_state, self.n_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt).to(torch.promote_types(x.dtype, torch.float32)))
        A = -torch.exp(self.A_log.to(dt.dtype))
        y, h1 = scan(x, dt, A, B, C, h0)
        y = y + x * self.D.to(y.dtype)
        y = y * F.silu(z.to(y.dtype))
        return self.out_proj(y.to(u.dtype)), h1, conv1


class MambaBlock(nn.Module):
    """Pre-norm residual block around a mixer."""

    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = MambaMixer(cfg)

    def forward_chunk(
        self, r: torch.Tensor, h0: torch.Tensor, conv0: torch.Tensor, *, scan: ScanFn = selective_scan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream r [B, T, H] in, (r out, h1, conv1) out, from layer state (h0, conv0)."""
        out, h1, conv1 = self.mixer.forward_chunk(self.norm(r), h0, conv0, scan=scan)
        if self.residual_in_fp32 and r.dtype in (torch.float16, torch.bfloat16):
            r = r.float()
        return r + out.to(r.dtype), h1, conv1


class Backbone(nn.Module):
    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class MambaOutput(NamedTuple):
    logits: torch.Tensor | None  # [B, T, V], float32 at least
    states: list  # per layer (a LayerState for Mamba layers), after the last token


class RecurrentLM(nn.Module):
    """What every SSM LM here shares: a `backbone` (embeddings, layers with `forward_chunk` and a
    mixer with `zero_state`, norm_f) and an `lm_head`; the state is passed in and handed back.

    A layer's state is a NamedTuple of tensors (Mamba: h and the conv tail; attention: the keys and
    values so far; an MLP: none): forward_chunk(r, *state) returns (r, *state after)."""

    backbone: nn.Module
    lm_head: nn.Linear

    def zero_states(self, batch: int) -> list[tuple]:
        """Fresh per-layer states for `batch` sequences."""
        like = self.backbone.embeddings.weight
        return [layer.mixer.zero_state(batch, like) for layer in self.backbone.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        states: list[tuple] | None = None,
        *,
        compute_logits: bool = True,
    ) -> MambaOutput:
        """Run input_ids [B, T] from `states` (default: zero); returns logits and the new states."""
        if states is None:
            states = self.zero_states(input_ids.shape[0])
        if len(states) != len(self.backbone.layers):
            raise ValueError(f"got {len(states)} layer states for {len(self.backbone.layers)} layers")
        r = self.backbone.embeddings(input_ids)
        new = []
        for layer, state in zip(self.backbone.layers, states):
            r, *after = layer.forward_chunk(r, *state)
            new.append(state._make(after))
        logits = None
        if compute_logits:
            hidden = self.backbone.norm_f(r)
            logits = self.logits(hidden)
        return MambaOutput(logits, new)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over final-norm hidden states, in float32 at least (as transformers)."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with the recurrent state: one O(1) step per new token; returns [B, T+n]."""
        out = self(input_ids)
        ids = [input_ids]
        for i in range(max_new_tokens):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            ids.append(nxt)
            if i + 1 < max_new_tokens:
                out = self(nxt, out.states)
        return torch.cat(ids, 1)


class MambaForCausalLM(RecurrentLM):
    """Mamba-1 causal LM with HF parameter names (backbone.*, lm_head)."""

    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.backbone = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_like_hf(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @torch.no_grad()
    def _init_like_hf(self, cfg: MambaConfig) -> None:
        # transformers' init: N(0, initializer_range) embeddings and in/x projections, zero biases;
        # out_proj and conv keep PyTorch's kaiming init, dt_proj Mamba's (see MambaMixer).
        std = cfg.initializer_range
        nn.init.normal_(self.backbone.embeddings.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for layer in self.backbone.layers:
            mixer = layer.mixer
            for lin in (mixer.in_proj, mixer.x_proj):
                nn.init.normal_(lin.weight, std=std)
            for bias in (mixer.in_proj.bias, mixer.out_proj.bias, mixer.conv1d.bias):
                if bias is not None:
                    bias.zero_()
            if cfg.rescale_prenorm_residual:
                mixer.out_proj.weight /= math.sqrt(cfg.num_hidden_layers)


# ---- checkpoints -------------------------------------------------------------------------------


def _read_json(file: Path) -> dict[str, Any]:
    """A model directory's config.json; a missing directory or file is named in one line."""
    if not file.is_file():
        what = f"model directory {str(file.parent)!r}"
        raise FileNotFoundError(f"{what} has no {file.name}" if file.parent.is_dir() else
                                f"{what} does not exist; pass a local HF directory (reclaim never downloads models)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e


def load_mamba(path: str | os.PathLike, dtype: torch.dtype | None = None) -> MambaForCausalLM:
    """Load an HF Mamba directory (config.json + safetensors) or a mamba_ssm one (pytorch_model.bin)."""
    from reclaim.models.loading import SafetensorsSource

    path = Path(path)
    raw = _read_json(path / "config.json")
    if "d_model" in raw:
        cfg = MambaConfig.from_mamba_ssm(raw)
    else:
        cfg = MambaConfig.from_hf(raw)
    if (path / MAMBA_SSM_WEIGHTS).is_file() and not any(path.glob("*.safetensors")):
        state = torch.load(path / MAMBA_SSM_WEIGHTS, map_location="cpu", weights_only=True)
    else:
        src = SafetensorsSource(path)
        state = {k: src[k] for k in src}
    state = mamba_ssm_to_hf_keys(state)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = MambaForCausalLM(cfg)
    expect = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, unexpected = expect - set(state), set(state) - expect
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match the config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False)
    return model.to(dtype) if dtype is not None else model


def write_mamba(model: MambaForCausalLM, path: Path, layout: str = "hf") -> None:
    """Write `model` into the existing directory `path` as an HF ('hf') or mamba_ssm layout."""
    from reclaim.models.loading import write_weights

    if layout not in ("hf", "mamba_ssm"):
        raise ValueError(f"unknown layout {layout!r}; supported: ['hf', 'mamba_ssm']")
    cfg = model.config
    if layout == "hf":
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        conf = {**cfg.to_hf(), "torch_dtype": dtype}
        (path / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        write_weights(model, cfg, path, "5GB")
    else:
        (path / "config.json").write_text(json.dumps(cfg.to_mamba_ssm(), indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        torch.save(hf_to_mamba_ssm_keys(state), path / MAMBA_SSM_WEIGHTS)


def save_mamba(model: MambaForCausalLM, path: str | os.PathLike, *, layout: str = "hf") -> Path:
    """Write `model` atomically as an HF directory (layout='hf') or a mamba_ssm one ('mamba_ssm')."""
    from reclaim.storage import atomic_dir

    return atomic_dir(Path(path), lambda tmp: write_mamba(model, tmp, layout))
