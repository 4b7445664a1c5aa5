"""One loader for every state-space LM family (Mamba-1, Mamba-2, the Nemotron-H and Bamba hybrids): the config
names the family, the family's loader reads the weights; each family's config, writer and
checkpoint key names are here too, so a trainer treats every family alike."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from reclaim.models.loading import SSM_ARCHITECTURES, ssm_family  # noqa: F401 - re-exported
from reclaim.models.bamba import BambaConfig, BambaForCausalLM, load_bamba, write_bamba
from reclaim.models.mamba import MambaConfig, MambaForCausalLM, _read_json, load_mamba, write_mamba
from reclaim.models.mamba2 import Mamba2Config, Mamba2ForCausalLM, load_mamba2, write_mamba2
from reclaim.models.nemotron_h import (NemotronHConfig, NemotronHForCausalLM, load_nemotron_h,
                                       to_file_name, write_nemotron_h)


class Family(NamedTuple):
    """What reclaim knows of one SSM architecture."""

    model_type: str
    config: type  # its config dataclass (HF field names, `from_hf`)
    model: type
    load: Callable[..., nn.Module]  # load(path, dtype)
    write: Callable[[nn.Module, Path], None]  # write(model, existing directory): an HF directory
    file_name: Callable[[str], str]  # a parameter name as the checkpoint files spell it


def _same(name: str) -> str:
    return name


# architecture -> family. mamba_ssm directories (no model_type, a d_model key) are Mamba-1 layouts
# that load_mamba reads (and refuses for their other layers, by name). Which architecture a
# config.json names is ssm_family's (in loading.py, where the decoder's loader also uses it to
# refuse an SSM by name).
FAMILIES = {
    "MambaForCausalLM": Family("mamba", MambaConfig, MambaForCausalLM, load_mamba, write_mamba, _same),
    "Mamba2ForCausalLM": Family("mamba2", Mamba2Config, Mamba2ForCausalLM, load_mamba2, write_mamba2,
                                _same),
    "NemotronHForCausalLM": Family("nemotron_h", NemotronHConfig, NemotronHForCausalLM,
                                   load_nemotron_h, write_nemotron_h, to_file_name),
    "BambaForCausalLM": Family("bamba", BambaConfig, BambaForCausalLM, load_bamba, write_bamba, _same),
}
assert {a: f.model_type for a, f in FAMILIES.items()} == SSM_ARCHITECTURES


def _supported() -> str:
    return ", ".join(f"{a} ({f.model_type})" for a, f in FAMILIES.items())


def family_of(model: nn.Module) -> Family:
    """The family of a model built here."""
    for family in FAMILIES.values():
        if type(model) is family.model:
            return family
    raise ValueError(f"{type(model).__name__} is not an SSM family here; supported: {_supported()}")


def build_ssm(architecture: str, fields: dict[str, Any]) -> nn.Module:
    """A randomly initialised model of `architecture` from HF config.json `fields`; a field the
    family's config does not have is refused by name."""
    if architecture not in FAMILIES:
        raise ValueError(f"unsupported SSM architecture {architecture!r}; supported: {_supported()}")
    family = FAMILIES[architecture]
    cfg = family.config.from_hf(fields)
    if cfg.extra:
        raise ValueError(f"{architecture} has no config field(s) {sorted(cfg.extra)}; its fields: "
                         f"{sorted(set(family.config.__dataclass_fields__) - {'extra'})}")
    return family.model(cfg)


def load_ssm(
    path: str | os.PathLike, dtype: torch.dtype | None = None
) -> MambaForCausalLM | Mamba2ForCausalLM | NemotronHForCausalLM | BambaForCausalLM:
    """Load a Mamba-1, Mamba-2, Nemotron-H or Bamba directory, whichever its config.json names;
    refuse others by name."""
    arch = ssm_family(_read_json(Path(path) / "config.json"))
    return FAMILIES[arch].load(path, dtype)
