"""Config loading: YAML or a bundled name, `--field value` overrides, typed by pydantic, errors
that name the field and what it takes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from reclaim.config import ConfigError, bundled_configs, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RunConfig:
    """A config shaped like the trainers' (HF/TRL field names)."""

    output_dir: str = "runs/x"
    learning_rate: float = 1e-5
    num_generations: int = 8
    max_completion_length: int | None = None
    beta: float = 0.0
    use_vllm: bool = False
    gradient_checkpointing: bool = True
    reward_funcs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (a group), got {self.num_generations}")


def test_yaml_then_overrides_typed_from_strings(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1.0e-6\nnum_generations: 4\nreward_funcs: [length]\n")
    cfg = load_config(RunConfig, path, ["--num-generations", "16", "--beta=0.04",
                                        "--max_completion_length", "256", "--output_dir", "007"])
    assert cfg == RunConfig(output_dir="007", learning_rate=1e-6, num_generations=16,
                            max_completion_length=256, beta=0.04, reward_funcs=["length"])
    assert load_config(RunConfig, None, ["--learning_rate", "3e-4"]).learning_rate == 3e-4
    assert load_config(RunConfig, path, {"num_generations": 2}).num_generations == 2
    assert load_config(RunConfig, None, ["--reward_funcs", "[a, b]"]).reward_funcs == ["a", "b"]


def test_bool_flags_and_none():
    assert parse_overrides(RunConfig, ["--use_vllm", "--beta", "0.1"]) == {"use_vllm": True, "beta": 0.1}
    assert parse_overrides(RunConfig, ["--beta", "0.1", "--use-vllm"]) == {"beta": 0.1, "use_vllm": True}
    assert parse_overrides(RunConfig, ["--no_gradient_checkpointing"]) == {"gradient_checkpointing": False}
    assert parse_overrides(RunConfig, ["--use_vllm", "false"]) == {"use_vllm": False}
    assert parse_overrides(RunConfig, ["--use_vllm=yes"]) == {"use_vllm": True}
    assert load_config(RunConfig, None, ["--max_completion_length", "none"]).max_completion_length is None
    assert load_config(RunConfig, None, ["--output_dir", "none"]).output_dir == "none"  # a str field


def test_unknown_field_is_named_with_the_allowed_ones(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, None, ["--learning_rte", "1e-5"])
    msg = str(e.value)
    assert "'learning_rte'" in msg and "did you mean 'learning_rate'" in msg
    assert "allowed: ['beta', 'gradient_checkpointing'" in msg
    (tmp_path / "bad.yaml").write_text("num_generation: 4\n")
    with pytest.raises(ConfigError, match=r"num_generation.*bad\.yaml.*allowed"):
        load_config(RunConfig, tmp_path / "bad.yaml")


@pytest.mark.parametrize("overrides,where", [
    (["--num_generations", "many"], "num_generations='many': num_generations takes int"),
    (["--num_generations", "2.5"], "num_generations=2.5: num_generations takes int"),
    ({"num_generations": True}, "num_generations=True: num_generations takes int, not a boolean"),
    (["--use_vllm", "maybe"], "use_vllm='maybe': use_vllm takes bool"),
    (["--max_completion_length", "long"], "takes int | None"),
    ({"output_dir": 7}, "output_dir=7: output_dir takes str"),
])
def test_wrong_type_names_field_value_and_type(overrides, where):
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, None, overrides)
    assert where in str(e.value)


def test_dataclass_checks_run_and_their_message_is_kept():
    with pytest.raises(ConfigError, match=r"^num_generations must be >= 2 \(a group\), got 1$"):
        load_config(RunConfig, None, ["--num_generations", "1"])


def test_malformed_command_lines_and_files(tmp_path):
    with pytest.raises(ConfigError, match="expected --field value, got 'beta'"):
        parse_overrides(RunConfig, ["beta", "1"])
    with pytest.raises(ConfigError, match=r"--beta needs a value \(beta takes float\)"):
        parse_overrides(RunConfig, ["--beta"])
    with pytest.raises(ConfigError, match="--beta needs a value"):
        parse_overrides(RunConfig, ["--beta", "--use_vllm"])
    with pytest.raises(ConfigError, match=r"\['use_vlm'\] in the command line \(.*'use_vllm'\?\)"):
        parse_overrides(RunConfig, ["--use-vlm", "--beta", "1"])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of field: value"):
        load_config(RunConfig, tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match=r"neither a file nor a bundled config; bundled: \["):
        load_config(RunConfig, "no-such-config")


def test_bundled_configs_load_by_name_or_path():
    from reclaim.ssm.train import SSMTrainConfig

    assert {"ssm-tiny", "ssm-64k", "ssm-128k-time"} <= set(bundled_configs())
    tiny = load_config(SSMTrainConfig, "ssm-tiny")
    assert tiny == load_config(SSMTrainConfig, "ssm-tiny.yaml")
    assert tiny == load_config(SSMTrainConfig, ROOT / "reclaim" / "configs" / "ssm-tiny.yaml")
    assert (tiny.d_model, tiny.context_length) == (64, 512)


@pytest.mark.slow
def test_wheel_ships_the_bundled_configs(tmp_path):
    """A normal (non-editable) install gets the configs `reclaim demo` and the README use."""
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT / "reclaim", src / "reclaim", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("reclaim-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"reclaim/configs/{n}.yaml" for n in bundled_configs()} <= names
    # Installed from the wheel alone (not this checkout), the demo's config loads by name.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import reclaim, reclaim.config as c, reclaim.ssm.train as t; "
            "print(reclaim.__file__); print(c.load_config(t.SSMTrainConfig, 'ssm-tiny').d_model)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, d_model = proc.stdout.split()
    assert Path(where).is_relative_to(site) and d_model == "64"
