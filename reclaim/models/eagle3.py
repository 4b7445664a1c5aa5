"""EAGLE-3 drafter: one decoder layer fed the target's low, middle and high hidden states.

    f_i = fc(cat(a_i, b_i, c_i))                       the states entering three target layers at i
    g_i = midlayer(embed(x_{i+1}), f_i)                q/k/v take cat(input_layernorm(e), hidden_norm(f))
    logits_{i+2} = lm_head(norm(g_i))                  its own head, over the draft vocabulary

After the first draft token the drafter feeds its own g in place of f (no fc then: a feature
whose width is the fc's input is the target's, anything else is the drafter's own). The
midlayer's residual is f, its output g = f + attention + MLP (pre-norm: what is fed back).

On disk it is the EAGLE-3 layout vLLM (model_executor/models/llama_eagle3.py) and SGLang
(srt/models/llama_eagle3.py) load: model.safetensors with `fc.weight`, `midlayer.*`,
`norm.weight`, `lm_head.weight`, `d2t` (draft index -> target id offset) and `t2d` (target ids
in the draft vocabulary); config.json is a one-layer Llama config with architectures
["LlamaForCausalLMEagle3"], draft_vocab_size, target_hidden_size, tie_word_embeddings false
(SGLang would tie lm_head to the embeddings otherwise), and the aux layers twice:
`eagle_aux_hidden_state_layer_ids` (vLLM: the state entering layer i) and
`eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang and SpecForge: the output of layer i,
so one less). The embeddings are the target's (not stored; both loaders share them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from reclaim.models.cache import AttentionCache
from reclaim.models.drafter import EAGLE3_ARCHITECTURES, WEIGHTS_NAME, check_draft_ids, drafter_layout
from reclaim.models.kernels.linear import Linear
from reclaim.models.llama import MLP, Attention, check_aux_layers, rope_inv_freq
from reclaim.models.llama_config import LlamaConfig
from reclaim.models.norm import RMSNorm

ARCHITECTURE = EAGLE3_ARCHITECTURES[0]
# config.json keys of the EAGLE-3 layout beside the one-layer Llama config.
LAYOUT_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "eagle_config")
NUM_AUX = 3  # vLLM's and SGLang's fc takes 3 * target_hidden_size


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and SGLang's default: the states entering layers 2, L // 2 and L - 3 (EAGLE-3's
    low, middle, high); a target too shallow for distinct ones takes 0, L // 2 and L - 1."""
    ids = (2, num_layers // 2, num_layers - 3)
    return ids if len(set(ids)) == 3 and ids[-1] > ids[1] else (0, num_layers // 2, num_layers - 1)


class Midlayer(nn.Module):
    """EAGLE-3's decoder layer: attention over cat(normed embedding, normed feature) (2H wide)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, Linear(2 * h, old.out_features, bias=False))
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, feats, cos, sin, cache):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feats)], dim=-1)
        h = feats + self.self_attn(x, cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """fc, the midlayer, a final norm and a head over the draft vocabulary (embeddings: the target's)."""

    def __init__(self, cfg: LlamaConfig, aux_layers: Sequence[int], draft_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        if len(aux_layers) != NUM_AUX:
            raise ValueError(f"aux_layers={list(aux_layers)}: an EAGLE-3 drafter takes {NUM_AUX} target layers")
        self.config = dataclasses.replace(cfg, num_hidden_layers=1)
        self.aux_layers = tuple(aux_layers)
        h = cfg.hidden_size
        self.fc = Linear(NUM_AUX * h, h, bias=False)
        self.midlayer = Midlayer(self.config)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        ids = None if draft_ids is None else check_draft_ids(draft_ids, cfg.vocab_size)
        self.lm_head = Linear(h, cfg.vocab_size if ids is None else ids.numel(), bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)
        self.register_buffer("draft_ids", ids, persistent=False)  # target ids of the head's rows (None: all)

    @property
    def layers(self) -> tuple[Midlayer]:
        """Its decoder layers (the one midlayer), as EagleDrafter's `layers` for code that walks them."""
        return (self.midlayer,)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: AttentionCache | None = None) -> torch.Tensor:
        """The drafter's states g [B, T, H] at `positions` [B, T] from token embeddings and either
        the target's aux states [B, T, 3H] or the drafter's own earlier g [B, T, H]."""
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] == self.fc.in_features:
            hidden = self.fc(hidden)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return self.midlayer(embeds, hidden, emb.cos().to(hidden.dtype), emb.sin().to(hidden.dtype), cache)

    def head(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 logits [..., N] over the draft vocabulary and its target ids (None: all V)."""
        return self.lm_head(self.norm(g)).float(), self.draft_ids


def drafter_config(target_cfg: LlamaConfig) -> LlamaConfig:
    """The drafter's one-layer Llama config: the target's shape (any Llama-family target; vLLM's
    and SGLang's EAGLE-3 layer is Llama's), no biases, no window, untied head."""
    t = target_cfg
    return LlamaConfig(
        model_type="llama", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_hidden_layers=1, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, rope_scaling=t.rope_scaling, tie_word_embeddings=False,
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id)


@torch.no_grad()
def new_eagle3(target: nn.Module, aux_layers: Sequence[int] | None = None,
               draft_ids: torch.Tensor | None = None) -> Eagle3Drafter:
    """A fresh drafter for `target` in its dtype and device, its head starting as the target's
    rows of the draft vocabulary (its norm at ones: the target's own, up to 3.3 on SmolLM2, makes
    the untrained drafter's logits far too sharp)."""
    cfg = target.config
    aux = default_aux_layers(cfg.num_hidden_layers) if aux_layers is None else tuple(aux_layers)
    check_aux_layers(aux, cfg.num_hidden_layers)
    p = next(target.parameters())
    drafter = Eagle3Drafter(drafter_config(cfg), aux, draft_ids).to(device=p.device, dtype=p.dtype)
    w = target.lm_head.weight
    drafter.lm_head.weight.copy_(w if draft_ids is None else w[drafter.draft_ids.to(w.device)])
    return drafter


def vocab_maps(ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """EAGLE-3's draft vocabulary tensors for target ids `ids` (ascending): d2t, each draft index's
    offset to its target id (int64), and t2d, which target ids are in it (bool [vocab_size])."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


def save_eagle3(drafter: Eagle3Drafter, path: str | os.PathLike) -> Path:
    """Write the EAGLE-3 layout (config.json + model.safetensors) atomically; returns the path."""
    from reclaim.storage import atomic_dir

    def write(out: Path) -> None:
        cfg = drafter.config.to_hf()
        n = drafter.lm_head.out_features
        cfg.update(architectures=[ARCHITECTURE], draft_vocab_size=n, target_hidden_size=drafter.config.hidden_size,
                   eagle_aux_hidden_state_layer_ids=list(drafter.aux_layers),
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.aux_layers],
                                 "use_aux_hidden_state": True},
                   torch_dtype=str(next(drafter.parameters()).dtype).removeprefix("torch."))
        tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
        ids = torch.arange(n) if drafter.draft_ids is None else drafter.draft_ids.cpu()
        tensors.update(vocab_maps(ids, drafter.config.vocab_size))
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})

    return atomic_dir(Path(path), write)


def load_eagle3(path: str | os.PathLike, target: nn.Module) -> Eagle3Drafter:
    """An EAGLE-3 drafter for `target` from `path`, in the target's dtype and device; a directory
    in the EAGLE-1/2 layout or one made for another target is refused, naming the value."""
    path = Path(path).expanduser()
    where = f"EAGLE-3 drafter {str(path)!r}"
    if drafter_layout(path) != "eagle3":
        raise ValueError(f"{str(path)!r} is an EAGLE-1/2 drafter (fc over 2H, layers.0.*); EAGLE-3 takes "
                         f"architectures {list(EAGLE3_ARCHITECTURES)} with midlayer.* weights: use eagle:PATH for it")
    raw = json.loads((path / "config.json").read_text())
    meta = {k: raw.pop(k, None) for k in LAYOUT_KEYS}
    raw.pop("architectures", None)
    if raw.pop("norm_before_residual", False):
        raise ValueError(f"{where} sets norm_before_residual=true; allowed: false (the residual is the "
                         "feature before hidden_norm)")
    cfg = LlamaConfig.from_hf(raw)
    tc = target.config
    aux = tuple(meta["eagle_aux_hidden_state_layer_ids"] or default_aux_layers(tc.num_hidden_layers))
    for name, mine, theirs in (("vocab_size", cfg.vocab_size, tc.vocab_size),
                               ("hidden_size", cfg.hidden_size, tc.hidden_size),
                               ("target_hidden_size", meta["target_hidden_size"] or cfg.hidden_size, tc.hidden_size)):
        if mine != theirs:
            raise ValueError(f"{where} has {name}={mine} but the target has {'hidden_size' if 'hidden' in name else name}"
                             f"={theirs}; allowed: {theirs} (a drafter trained for this target)")
    try:
        check_aux_layers(aux, tc.num_hidden_layers)
    except ValueError as e:
        raise ValueError(f"{where} was made for a deeper target: {e}") from None
    tensors = load_file(str(path / WEIGHTS_NAME))
    d2t, _ = tensors.pop("d2t", None), tensors.pop("t2d", None)
    tensors = {k.replace("layers.0.", "midlayer.", 1): v for k, v in tensors.items() if not k.startswith("embed_tokens.")}
    rows = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else None
    if meta["draft_vocab_size"] not in (None, rows) or (d2t is not None and d2t.numel() != rows):
        raise ValueError(f"{where}: draft_vocab_size={meta['draft_vocab_size']}, d2t of "
                         f"{None if d2t is None else d2t.numel()} and lm_head of {rows} rows must agree")
    full = d2t is None or bool((d2t == 0).all()) and rows == cfg.vocab_size
    drafter = Eagle3Drafter(cfg, aux, None if full else torch.arange(d2t.numel()) + d2t)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{where}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}; expected "
                         "fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d")
    p = next(target.parameters())
    return drafter.to(device=p.device, dtype=p.dtype).eval()
