"""One loader for every state-space LM family (Mamba-1, Mamba-2, the Nemotron-H hybrid): the config
names the family, the family's loader reads the weights."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from reclaim.models.mamba import MambaForCausalLM, _read_json, load_mamba
from reclaim.models.mamba2 import Mamba2ForCausalLM, load_mamba2
from reclaim.models.nemotron_h import NemotronHForCausalLM, load_nemotron_h

# architecture -> (model_type, loader). mamba_ssm directories (no model_type, a d_model key) are
# Mamba-1 layouts that load_mamba reads (and refuses for their other layers, by name).
FAMILIES = {
    "MambaForCausalLM": ("mamba", load_mamba),
    "Mamba2ForCausalLM": ("mamba2", load_mamba2),
    "NemotronHForCausalLM": ("nemotron_h", load_nemotron_h),
}


def ssm_family(config: dict) -> str:
    """The architecture a config.json dict names, if it is a supported SSM; else ValueError."""
    if "d_model" in config and "model_type" not in config:
        return "MambaForCausalLM"
    archs = config.get("architectures") or []
    kind = config.get("model_type")
    for arch, (model_type, _) in FAMILIES.items():
        if arch in archs or (not archs and kind == model_type):
            return arch
    supported = ", ".join(f"{a} ({t})" for a, (t, _) in FAMILIES.items())
    raise ValueError(f"unsupported SSM architecture {archs or None} (model_type {kind!r}); "
                     f"supported: {supported}")


def load_ssm(
    path: str | os.PathLike, dtype: torch.dtype | None = None
) -> MambaForCausalLM | Mamba2ForCausalLM | NemotronHForCausalLM:
    """Load a Mamba-1, Mamba-2 or Nemotron-H directory, whichever its config.json names; refuse
    others by name."""
    arch = ssm_family(_read_json(Path(path) / "config.json"))
    return FAMILIES[arch][1](path, dtype)
