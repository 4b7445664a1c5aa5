"""Mamba-2 language model with transformers' `Mamba2ForCausalLM` parameter names.

Each block: r + out_proj(norm(ssd(silu(conv(x, B, C))) + D x, gate)) with [gate, xBC, dt] =
in_proj(RMSNorm(r)). The SSD scan has one decay per head, exp(dt A_h), and B, C shared by the heads
of each of n_groups groups; dt = clamp(softplus(dt + dt_bias), time_step_limit); the gated norm
multiplies by silu(gate) before an RMSNorm over each group's channels. The layer state is (h
[B, heads, head_dim, state], conv tail [B, conv channels, K-1]), passed in and handed back as in
`mamba.py`, whose LM methods (forward, logits, generate) and conv this model shares.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reclaim.models.kernels.scan import ScanFn
from reclaim.models.mamba import LayerState, RecurrentLM, _read_json, causal_conv
from reclaim.models.norm import GatedRMSNorm, RMSNorm
from reclaim.models.ssd import ssd_scan

HF_ARCH = "Mamba2ForCausalLM"
MODEL_TYPE = "mamba2"


def from_hf_fields(cls: type, d: dict[str, Any], drop: tuple[str, ...] = ("model_type", "architectures")) -> Any:
    """A family's config dataclass from an HF config.json dict: its own fields, the rest (but
    `drop`) kept in `extra` for the round trip."""
    names = set(cls.__dataclass_fields__) - {"extra"}
    extra = {k: v for k, v in d.items() if k not in names and k not in drop}
    return cls(**{k: v for k, v in d.items() if k in names}, extra=extra)


def to_hf_fields(cfg: Any, model_type: str, architecture: str, **more: Any) -> dict[str, Any]:
    """The HF config.json dict of a family's config dataclass (time_step_limit as a list)."""
    d = asdict(cfg)
    extra = d.pop("extra")
    d["time_step_limit"] = list(cfg.time_step_limit)
    return {**extra, **d, **more, "model_type": model_type, "architectures": [architecture]}


@dataclass
class Mamba2Config:
    """Shape of a Mamba-2 LM; field names and defaults are those of the HF Mamba2Config."""

    num_heads: int = 128
    head_dim: int = 64
    vocab_size: int = 32768
    hidden_size: int = 4096
    state_size: int = 128
    num_hidden_layers: int = 64
    layer_norm_epsilon: float = 1e-5
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    expand: int = 2
    conv_kernel: int = 4
    n_groups: int = 8
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    initializer_range: float = 0.1
    residual_in_fp32: bool = True
    time_step_rank: int | str = "auto"  # unused by Mamba-2 (dt comes from in_proj); kept for HF
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    rescale_prenorm_residual: bool = False
    chunk_size: int = 256  # the fused kernel's chunk; the SSD here picks its own (same result)
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: ['silu']")
        if self.n_groups < 1 or self.num_heads < 1 or self.num_heads % self.n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a positive multiple of "
                             f"n_groups ({self.n_groups})")
        if self.intermediate_size != self.num_heads * self.head_dim:
            raise ValueError(f"hidden_size * expand ({self.intermediate_size}) must equal num_heads * "
                             f"head_dim ({self.num_heads} * {self.head_dim})")
        if self.conv_kernel < 1:
            raise ValueError(f"conv_kernel must be >= 1, got {self.conv_kernel}")
        lo, hi = self.time_step_limit = tuple(float(v) for v in self.time_step_limit)
        if not 0.0 <= lo <= hi:
            raise ValueError(f"time_step_limit must be (min, max) with 0 <= min <= max, got {self.time_step_limit}")

    @property
    def intermediate_size(self) -> int:
        return int(self.expand * self.hidden_size)

    def layer_shape(self) -> "SSDLayerShape":
        """The fields a mixer is built from."""
        return SSDLayerShape(
            self.hidden_size, self.num_heads, self.head_dim, self.state_size, self.n_groups,
            self.conv_kernel, self.use_bias, self.use_conv_bias, self.layer_norm_epsilon,
            self.time_step_limit, self.time_step_min, self.time_step_max, self.time_step_floor,
        )

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Mamba2Config":
        """Build from an HF config.json dict; unknown keys are kept in `extra` for the round trip."""
        d = dict(d)
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"model_type {d['model_type']!r} is not a Mamba-2 config; expected {MODEL_TYPE!r}")
        if "dtype" in d:
            d.setdefault("torch_dtype", d.pop("dtype"))
        return from_hf_fields(cls, d)

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict."""
        return to_hf_fields(self, MODEL_TYPE, HF_ARCH)


@dataclass(frozen=True)
class SSDLayerShape:
    """What a Mamba-2 mixer is built from: the fields every family that carries one (Mamba-2,
    Nemotron-H) derives from its own config."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    use_bias: bool
    use_conv_bias: bool
    eps: float
    time_step_limit: tuple[float, float]
    time_step_min: float
    time_step_max: float
    time_step_floor: float

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, then B and C of every group."""
        return self.num_heads * self.head_dim + 2 * self.n_groups * self.state_size


class Mamba2Mixer(nn.Module):
    """The SSD mixer of one layer (HF Mamba2Mixer parameters)."""

    def __init__(self, cfg: SSDLayerShape) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        if cfg.num_heads % cfg.n_groups:
            raise ValueError(f"the Mamba-2 head count ({cfg.num_heads}) must be a multiple of its group "
                             f"count ({cfg.n_groups})")
        self.d_inner, self.heads, self.head_dim = d, cfg.num_heads, cfg.head_dim
        self.groups, self.n_state, self.kernel = cfg.n_groups, cfg.state_size, cfg.conv_kernel
        self.dt_limit = cfg.time_step_limit
        self.in_proj = nn.Linear(h, d + cfg.conv_dim + cfg.num_heads, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim,
                                padding=cfg.conv_kernel - 1, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(cfg.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, cfg.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(cfg.num_heads))
        self.norm = GatedRMSNorm(d, d // cfg.n_groups, cfg.eps)
        self.out_proj = nn.Linear(d, h, bias=cfg.use_bias)
        self._init_dt(cfg)

    @torch.no_grad()
    def _init_dt(self, cfg: SSDLayerShape) -> None:
        # Mamba's init: dt = softplus(dt_bias) log-uniform in [time_step_min, time_step_max].
        lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
        dt = torch.exp(torch.rand(self.heads) * (hi - lo) + lo).clamp(min=cfg.time_step_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def zero_state(self, batch: int, like: torch.Tensor) -> LayerState:
        """The state every sequence starts from."""
        dtype = torch.promote_types(like.dtype, torch.float32)
        return LayerState(
            like.new_zeros(batch, self.heads, self.head_dim, self.n_state, dtype=dtype),
            like.new_zeros(batch, self.conv1d.in_channels, self.kernel - 1),
        )

    def forward_chunk(
        self, u: torch.Tensor, h0: torch.Tensor, conv0: torch.Tensor, *, scan: ScanFn = ssd_scan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mix normed input u [B, T, H] from state (h0, conv0); returns (out, h1, conv1).

        scan: the kernel, called as scan(x, dt, A, B, C, h0) -> (y, h1) with per-head shapes (see
        `ssd_scan`).
        """
        b, t, _ = u.shape
        gate, xbc, dt = self.in_proj(u).split([self.d_inner, self.conv1d.in_channels, self.heads], dim=-1)
        xbc, conv1 = causal_conv(self.conv1d, xbc, conv0)
        x, B, C = F.silu(xbc).split([self.d_inner, self.groups * self.n_state, self.groups * self.n_state],
                                    dim=-1)
        dtype = torch.promote_types(x.dtype, torch.float32)
        dt = F.softplus((dt + self.dt_bias).to(dtype)).clamp(*self.dt_limit)
        A = -torch.exp(self.A_log.to(dtype))
        x = x.view(b, t, self.heads, self.head_dim)
        y, h1 = scan(x, dt, A, B.view(b, t, self.groups, -1), C.view(b, t, self.groups, -1), h0)
        y = y + x.to(y.dtype) * self.D.to(y.dtype)[:, None]
        y = self.norm(y.flatten(2), gate)
        return self.out_proj(y.to(u.dtype)), h1, conv1


class Mamba2Block(nn.Module):
    """Pre-norm residual block around a Mamba-2 mixer."""

    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(cfg.layer_shape())

    def forward_chunk(
        self, r: torch.Tensor, h0: torch.Tensor, conv0: torch.Tensor, *, scan: ScanFn = ssd_scan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream r [B, T, H] in, (r out, h1, conv1) out, from layer state (h0, conv0)."""
        out, h1, conv1 = self.mixer.forward_chunk(self.norm(r), h0, conv0, scan=scan)
        if self.residual_in_fp32 and r.dtype in (torch.float16, torch.bfloat16):
            r = r.float()
        return r + out.to(r.dtype), h1, conv1


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class Mamba2ForCausalLM(RecurrentLM):
    """Mamba-2 causal LM with HF parameter names (backbone.*, lm_head)."""

    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.config = cfg
        self.backbone = Mamba2Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_like_hf(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @torch.no_grad()
    def _init_like_hf(self, cfg: Mamba2Config) -> None:
        # transformers' init: N(0, initializer_range) embeddings, head and in_proj, zero biases;
        # out_proj and conv keep PyTorch's kaiming init, A_log, D and dt_bias Mamba's (the mixer).
        std = cfg.initializer_range
        for w in (self.backbone.embeddings.weight, self.lm_head.weight):
            nn.init.normal_(w, std=std)
        for layer in self.backbone.layers:
            mixer = layer.mixer
            nn.init.normal_(mixer.in_proj.weight, std=std)
            for bias in (mixer.in_proj.bias, mixer.out_proj.bias, mixer.conv1d.bias):
                if bias is not None:
                    bias.zero_()
            if cfg.rescale_prenorm_residual:
                mixer.out_proj.weight /= math.sqrt(cfg.num_hidden_layers)


# ---- checkpoints -------------------------------------------------------------------------------


def check_shapes(model: nn.Module, state: dict[str, torch.Tensor], where: str, *, tied: bool) -> None:
    """Refuse a checkpoint whose tensors are not the model's: names, then shapes, named. A tied
    head is stored once, as the embedding."""
    expect = {k: v.shape for k, v in model.state_dict().items()}
    if tied:
        expect.pop("lm_head.weight")
    missing, unexpected = set(expect) - set(state), set(state) - set(expect)
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match the config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    for k, shape in expect.items():
        if state[k].shape != shape:
            raise ValueError(f"{where}: {k!r} has shape {list(state[k].shape)} in the checkpoint and "
                             f"{list(shape)} under its config")


def load_hf_ssm(path: str | os.PathLike, config_cls: type, model_cls: type, dtype: torch.dtype | None,
                rename: Callable[[str], str] = lambda k: k) -> nn.Module:
    """An HF directory of an SSM family (config.json + safetensors): the config read by
    `config_cls.from_hf`, each tensor named as the model's module (`rename`), a tied head's copy
    dropped, names and shapes checked, in `dtype` (default: the embedding's dtype in the file)."""
    from reclaim.models.loading import SafetensorsSource

    path = Path(path)
    cfg = config_cls.from_hf(_read_json(path / "config.json"))
    src = SafetensorsSource(path)
    state = {rename(k): src[k] for k in src}
    model = model_cls(cfg)
    tied = model.lm_head.weight is model.backbone.embeddings.weight
    if tied:
        state.pop("lm_head.weight", None)
    check_shapes(model, state, str(path), tied=tied)
    embed = next(n for n, p in model.named_parameters() if p is model.backbone.embeddings.weight)
    # In the asked dtype, else the checkpoint's: loading float64 weights into float32 would round them.
    model.to(dtype or state[embed].dtype).load_state_dict(state, strict=False)
    return model


def write_hf_ssm(model: nn.Module, path: Path, rename: Callable[[str], str] | None = None) -> None:
    """Write an SSM family's `model` into the existing directory `path` as an HF directory (files
    named by `rename`; a tied head stored once, as the embedding)."""
    from reclaim.models.loading import write_weights

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    conf = {**model.config.to_hf(), "torch_dtype": dtype}
    (path / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    tied = model.lm_head.weight is model.backbone.embeddings.weight
    write_weights(model, SimpleNamespace(tie_word_embeddings=tied), path, "5GB", rename=rename)


def load_mamba2(path: str | os.PathLike, dtype: torch.dtype | None = None) -> Mamba2ForCausalLM:
    """Load an HF Mamba-2 directory (config.json + safetensors). Old mamba_ssm-converted
    checkpoints name the embedding `embedding` (transformers renames it too)."""
    return load_hf_ssm(path, Mamba2Config, Mamba2ForCausalLM, dtype,
                       lambda k: k.replace("backbone.embedding.", "backbone.embeddings."))


def write_mamba2(model: Mamba2ForCausalLM, path: Path) -> None:
    """Write `model` into the existing directory `path` as an HF directory."""
    write_hf_ssm(model, path)


def save_mamba2(model: Mamba2ForCausalLM, path: str | os.PathLike) -> Path:
    """Write `model` atomically as an HF directory that transformers' Mamba2ForCausalLM loads."""
    from reclaim.storage import atomic_dir

    return atomic_dir(Path(path), lambda tmp: write_mamba2(model, tmp))
