"""One loader for every state-space LM family (Mamba-1, Mamba-2, the Nemotron-H hybrid): the config
names the family, the family's loader reads the weights."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from reclaim.models.loading import SSM_ARCHITECTURES, ssm_family
from reclaim.models.mamba import MambaForCausalLM, _read_json, load_mamba
from reclaim.models.mamba2 import Mamba2ForCausalLM, load_mamba2
from reclaim.models.nemotron_h import NemotronHForCausalLM, load_nemotron_h

# architecture -> (model_type, loader). mamba_ssm directories (no model_type, a d_model key) are
# Mamba-1 layouts that load_mamba reads (and refuses for their other layers, by name). Which
# architecture a config.json names is ssm_family's (in loading.py, where the decoder's loader
# also uses it to refuse an SSM by name).
LOADERS = {"MambaForCausalLM": load_mamba, "Mamba2ForCausalLM": load_mamba2, "NemotronHForCausalLM": load_nemotron_h}
FAMILIES = {arch: (model_type, LOADERS[arch]) for arch, model_type in SSM_ARCHITECTURES.items()}


def load_ssm(
    path: str | os.PathLike, dtype: torch.dtype | None = None
) -> MambaForCausalLM | Mamba2ForCausalLM | NemotronHForCausalLM:
    """Load a Mamba-1, Mamba-2 or Nemotron-H directory, whichever its config.json names; refuse
    others by name."""
    arch = ssm_family(_read_json(Path(path) / "config.json"))
    return FAMILIES[arch][1](path, dtype)
