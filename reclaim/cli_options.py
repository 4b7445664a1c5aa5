"""What the inference commands (generate, chat, demo, serve) share: their device, dtype and KV
cache options, the check that a model fits before any weight is read, and serve's options
generated from EngineConfig."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from reclaim.engine.config import DTYPES  # imports no torch
DTYPE_OPT = typer.Option("auto", "--dtype", help="Weights and KV cache: auto (float32 on a CPU, the "
                         "checkpoint's bfloat16 or float16 on CUDA), float32, bfloat16 or float16.")
KV_MEMORY_OPT = typer.Option(None, "--kv-cache-memory", help="KV cache budget in GiB (default 1 on a CPU); it must "
                             "hold one max-model-len sequence, and weights plus it must fit the device.")
DEVICE_OPT = typer.Option("auto", "--device", help="auto (CUDA when there is one, else cpu), cpu, cuda or cuda:N.")
MAX_LEN_OPT = typer.Option(None, "--max-model-len", help="Context length (default: the model's, at most 4096).")
GPU_UTIL_OPT = typer.Option(None, "--gpu-memory-utilization", help="CUDA: the share of the GPU's memory weights "
                            "and KV cache may take (default 0.9 unless --kv-cache-memory is given).")


class OneLineErrors(TyperGroup):
    """The `reclaim` command group: what a user got wrong about a path or a model (a missing model
    directory, config or data file; an SSM checkpoint given to the inference engine) ends in one
    line that names it, not a traceback; `reclaim --debug COMMAND` shows the traceback."""

    def invoke(self, ctx):
        from reclaim.models.loading import UnsupportedModelError

        try:
            return super().invoke(ctx)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
                UnsupportedModelError) as e:
            if ctx.params.get("debug"):
                raise
            typer.echo(f"Error: {e}", err=True)
            raise typer.Exit(1) from None


def bundled(prefix: str) -> str:
    """The configs bundled with the installed package whose names start with `prefix`, for a
    --config help (read from reclaim/configs/, so the list cannot go stale)."""
    from reclaim.config import bundled_configs

    return ", ".join(name for name in bundled_configs() if name.startswith(prefix))


def _fail(message: str) -> None:
    """Exit with a one-line error (no traceback, no usage box)."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(2)


def _fit(model: str | None, dtype: str, kv_cache_memory: float | None, *, max_model_len,
         max_num_seqs: int, device: str | None = None, block_size: int = 16, num_blocks: int | None = None,
         gpu_memory_utilization: float | None = None):
    """Resolve the device and dtype, and check, before any weight is read, that the model and its
    KV cache fit the device.

    `max_model_len(cfg)` gives the context length. Returns (model directory, max_model_len,
    KV cache bytes, device, dtype); a device that is not here, or a model that does not fit,
    exits with a one-line reason. The KV budget: --kv-cache-memory, else the pool --num-blocks
    gives, else on CUDA what --gpu-memory-utilization (0.9) leaves beside the weights, else 1 GiB.
    """
    from reclaim import devices
    from reclaim.engine.config import DEFAULT_KV_CACHE_BYTES
    from reclaim.engine.kv_cache import GIB, KVPool
    from reclaim.engine.memory import check_fits, weight_bytes
    from reclaim.models.loading import as_dtype, read_config, resolve_model_dir

    if dtype not in DTYPES:
        _fail(f"--dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    if kv_cache_memory is not None and (kv_cache_memory <= 0 or num_blocks is not None):
        raise typer.BadParameter(f"--kv-cache-memory {kv_cache_memory}: give a size > 0 GiB, and not "
                                 "together with --num-blocks")
    try:
        dev = devices.resolve_device(device)
        devices.check_utilization(gpu_memory_utilization)
    except ValueError as e:
        _fail(str(e))
    if gpu_memory_utilization is not None and dev.type != "cuda":
        _fail(f"--gpu-memory-utilization {gpu_memory_utilization} is for CUDA devices; on {dev} give "
              "--kv-cache-memory")
    path = resolve_model_dir(model)
    cfg = read_config(path)
    dtype = devices.resolve_dtype(dtype, dev, cfg.torch_dtype)
    max_len = max_model_len(cfg)
    try:
        if kv_cache_memory is not None:
            budget = int(kv_cache_memory * GIB)
        elif num_blocks is not None:  # an explicit pool size is the budget
            budget = num_blocks * block_size * KVPool.bytes_per_token(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, as_dtype(dtype))
        elif dev.type == "cuda":
            budget = devices.kv_budget(dev, gpu_memory_utilization or devices.DEFAULT_GPU_MEMORY_UTILIZATION,
                                       weight_bytes(path, as_dtype(dtype)))
        else:
            budget = DEFAULT_KV_CACHE_BYTES
        check_fits(path, cfg, dtype=as_dtype(dtype), device=dev, kv_cache_bytes=budget,
                   block_size=block_size, max_model_len=max_len, max_num_seqs=max_num_seqs)
    except ValueError as e:
        typer.echo(f"Error: {e}", err=True)
        raise typer.Exit(1) from e
    return path, max_len, budget, str(dev), dtype


def engine_options(command):
    """Give a command an option per EngineConfig field (`--max-num-seqs`, ...: the field's name,
    its help, its type), generated rather than written out; the command gets the ones given as
    `engine_fields` (a dict of field values)."""
    import inspect
    import typing

    from reclaim.engine.config import EngineConfig, cli_fields

    hints = typing.get_type_hints(EngineConfig)
    sig = inspect.signature(command, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "engine_fields"]
    extra = []
    for f in cli_fields():
        default = f" (default {f.default})" if f.default is not None and "flag_type" not in f.metadata else ""
        extra.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.metadata.get(
            "flag_type", hints[f.name]) | None, default=typer.Option(
            None, f.metadata.get("flag", "--" + f.name.replace("_", "-")), help=f.metadata["help"] + default)))

    def wrapper(**kwargs):
        given = {f.name: kwargs.pop(f.name) for f in cli_fields()}
        fields = {k: cli_value(k, v) for k, v in given.items() if v is not None}
        return command(engine_fields=fields, **kwargs)

    def cli_value(name: str, value):
        convert = EngineConfig.__dataclass_fields__[name].metadata.get("from_flag")
        return convert(value) if convert is not None else value

    wrapper.__name__, wrapper.__doc__ = command.__name__, command.__doc__
    wrapper.__signature__ = sig.replace(parameters=own + extra)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
    return wrapper


def _file_fields(path: str) -> dict:
    """The fields an --engine-config file sets."""
    import yaml

    from reclaim.config import read_config_text

    return yaml.safe_load(read_config_text(path)[1]) or {}


def _cuda(device: str | None) -> bool:
    """Whether `device` (None or auto: CUDA when there is one) resolves to CUDA; an invalid one is
    refused later, by _fit."""
    from reclaim import devices

    try:
        return devices.resolve_device(device).type == "cuda"
    except ValueError:
        return False


def _engine_config(path: str | None, fields: dict):
    """The EngineConfig of --engine-config (a YAML file or none) with the options given on top,
    every field checked by load_config."""
    from reclaim.config import load_config
    from reclaim.engine.config import EngineConfig

    return load_config(EngineConfig, path, fields)
