"""A LoRA checkpoint as PEFT's adapter folder, or merged into its base as a plain model.

The adapter folder is what `peft.PeftModel.from_pretrained(base, folder)` loads:
`adapter_config.json` (PEFT's own LoraConfig, naming the base folder) and
`adapter_model.safetensors` under PEFT's keys, with the run's tokenizer beside them.
The adapters are rebuilt from their tensor-parallel shards by the same streaming code
as a full model, then renamed (they are small: r x (in + out) per layer).

The merged model streams the base one tensor at a time: each adapted weight becomes
W + scaling * B @ A (computed in fp32, written in the requested dtype), every other
tensor is copied as it is. At most one base tensor and the adapters are in memory. A
tied base whose embedding or head was adapted is written untied (`lm_head.weight` its
own tensor, `tie_word_embeddings` false): the two no longer hold the same values, and
adding both changes to the one shared tensor (what PEFT's own merge does) would apply
the embedding's change to the head as well.
Both folders are written beside their destination and swapped into place at the end.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from meshtrain.checkpoint import files
from meshtrain.checkpoint.consolidate.driver import (
    check_dtype,
    consolidate_checkpoint,
    parse_size,
    swap_into_place,
)
from meshtrain.checkpoint.consolidate.peft_layout import (
    is_adapter,
    is_expert_adapter,
    is_router_adapter,
    peft_tensors,
    ranks,
    scalings,
    stored_deltas,
    target_parameters,
)
from meshtrain.checkpoint.consolidate.plan import file_names, split_into_files
from meshtrain.checkpoint.lora_base import base_identity, check_same_base, checkpoint_lora_state
from meshtrain.checkpoint.manifest import CheckpointError, resolve_checkpoint
from meshtrain.config import LoraSettings
from meshtrain.models.llama.parameter_names import EMBEDDING, LM_HEAD

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_targets(adapter_names: list[str]) -> list[str]:
    """The Linear layers' names (PEFT's `target_modules`) the adapters sit on, shortest
    form (a mixture's routers and experts are `target_parameters`)."""
    linear = [
        n
        for n in adapter_names
        if is_adapter(n) and not (is_expert_adapter(n) or is_router_adapter(n))
    ]
    return sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in linear})


def peft_config(settings: LoraSettings, adapters: dict[str, Any], base: str | None) -> dict:
    """The adapter_config.json PEFT writes for these adapters (its own LoraConfig's)."""
    from peft import LoraConfig  # noqa: PLC0415  (only LoRA's consolidation needs PEFT)

    rank_pattern = {rf".*\.{name}": r for name, r in ranks(adapters, settings.r).items()}
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=adapter_targets(list(adapters)),
        target_parameters=target_parameters(list(adapters)) or None,
        rank_pattern=rank_pattern,
        alpha_pattern={k: settings.lora_alpha * r / settings.r for k, r in rank_pattern.items()},
        use_rslora=settings.use_rslora,
        modules_to_save=settings.modules_to_save,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )
    # JSON as PEFT writes it: its sets (target_modules) as lists.
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_base(folder: str | Path) -> str | None:
    """The base model folder an adapter folder names (PEFT's base_model_name_or_path)."""
    config = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    return config.get("base_model_name_or_path")


def _adapters(root: Path, scratch: Path, dtype: str | None) -> dict[str, Any]:
    """The whole adapter tensors of checkpoint `root`, by meshtrain's names."""
    from safetensors.torch import load_file  # noqa: PLC0415  (torch only for LoRA)

    consolidate_checkpoint(root, scratch, progress=False, dtype=dtype)
    try:
        return load_file(scratch / files.HF_WEIGHTS)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def is_lora_checkpoint(checkpoint: str | Path) -> bool:
    return checkpoint_lora_state(resolve_checkpoint(Path(checkpoint))) is not None


def consolidate_lora(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    merged_dir: str | Path | None = None,
    base: str | Path | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
) -> dict[str, Any]:
    """The adapter folder at `output_dir`, and with `merged_dir` the merged model there;
    the adapter folder's summary, with the merged one under "merged"."""
    summary = write_adapter_folder(checkpoint, output_dir, dtype=dtype)
    if merged_dir is not None:
        summary["merged"] = merge_lora(
            checkpoint, merged_dir, base=base, dtype=dtype, max_shard_size=max_shard_size
        )
    return summary


def write_adapter_folder(
    checkpoint: str | Path, output_dir: str | Path, *, dtype: str | None = None
) -> dict[str, Any]:
    """PEFT's adapter folder of LoRA checkpoint `checkpoint`, at `output_dir`."""
    from safetensors.torch import save_file  # noqa: PLC0415

    root, state = _lora_checkpoint(checkpoint)
    output_dir = Path(output_dir)
    partial = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    adapters = _adapters(root, output_dir.with_name(output_dir.name + ".adapters"), dtype)
    partial.mkdir(parents=True)
    save_file(
        {key: tensor.contiguous() for key, tensor in peft_tensors(adapters).items()},
        partial / ADAPTER_WEIGHTS,
        metadata={"format": "pt"},
    )
    settings = LoraSettings(**state["settings"])
    config = peft_config(settings, dict(sorted(adapters.items())), state["base"]["folder"])
    (partial / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (root / files.TOKENIZER).is_dir():
        shutil.copytree(root / files.TOKENIZER, partial, dirs_exist_ok=True)
    swap_into_place(partial, output_dir)
    return {
        "checkpoint": str(root),
        "output_dir": str(output_dir),
        "lora": True,
        "base_model": state["base"]["folder"],
        "num_tensors": len(adapters),
        "num_parameters": sum(t.numel() for t in adapters.values()),
        "files": [ADAPTER_WEIGHTS],
        "total_size": sum(t.numel() * t.element_size() for t in adapters.values()),
    }


def merge_lora(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    base: str | Path | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
) -> dict[str, Any]:
    """The base with the checkpoint's adapters merged in, as a plain Hugging Face folder.
    `base`: the base folder (default: the one the adapters were trained on, which any
    other must equal)."""
    root, state = _lora_checkpoint(checkpoint)
    saved = state["base"]
    folder = Path(base or saved["folder"] or "")
    if saved["folder"] is None and base is None:
        raise CheckpointError(
            f"cannot merge {root}: its adapters were trained on a randomly initialised base "
            "(no model.init_from), which no folder holds; write the adapter folder instead."
        )
    from transformers import AutoConfig  # noqa: PLC0415

    config = AutoConfig.from_pretrained(folder).to_dict()  # as the run read it
    check_same_base(saved, base_identity(str(folder), config, 0), f"merge {root} into {folder}")
    scratch = Path(output_dir).with_name(Path(output_dir).name + ".adapters")
    adapters = _adapters(root, scratch, None)
    s = LoraSettings(**state["settings"])
    scaling = scalings(adapters, s.r, s.lora_alpha, s.use_rslora)
    changes = stored_deltas(config["model_type"], adapters, scaling)
    merged = {name: partial(_plus, change) for name, change in changes.items()}
    # The modules trained whole (modules_to_save) replace their base tensors.
    merged |= {n: partial(_instead, t) for n, t in adapters.items() if not is_adapter(n)}
    untie = bool(config.get("tie_word_embeddings")) and bool({EMBEDDING, LM_HEAD} & set(merged))
    copies = {LM_HEAD: EMBEDDING} if untie else {}
    return _write_merged(folder, merged, Path(output_dir), dtype, max_shard_size, copies)


def _plus(change: Callable[[], Any], base: Any) -> Any:
    return base + change()


def _instead(trained: Any, _base: Any) -> Any:
    return trained.float()


def _lora_checkpoint(checkpoint: str | Path) -> tuple[Path, dict[str, Any]]:
    root = resolve_checkpoint(Path(checkpoint))
    state = checkpoint_lora_state(root)
    if state is None:
        raise CheckpointError(
            f"{root} holds a full model, not LoRA adapters: consolidate it as it is "
            "(consolidation.merge_lora applies to LoRA runs)."
        )
    return root, state


def _write_merged(
    base: Path,
    merged: dict[str, Callable[[Any], Any]],
    output_dir: Path,
    dtype: str | None,
    max_shard_size: int | str,
    copies: dict[str, str],
) -> dict[str, Any]:
    """`copies`: tensors the base does not store, written from another it does (new name
    -> stored name), whose presence unties the model."""
    import torch  # noqa: PLC0415
    from safetensors import safe_open  # noqa: PLC0415

    from meshtrain.checkpoint.safetensors_format import (
        SafetensorsWriter,
        TensorSpec,
        dtype_name,
        folder_weight_files,
    )  # noqa: PLC0415

    dtype = check_dtype(dtype)
    limit = parse_size(max_shard_size)
    located = folder_weight_files(base)
    if located is None:
        raise CheckpointError(f"cannot merge into {base}: it holds no safetensors weights")
    source = {name: name for name in located} | copies
    located = {name: located[source[name]] for name in source}
    partial = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(str(p), "pt")) for p in set(located.values())}
        specs = []
        for name, path in located.items():
            piece = handles[path].get_slice(source[name])
            out = dtype or dtype_name(piece.get_dtype())
            specs.append(TensorSpec(name, out, tuple(piece.get_shape())))
        groups = split_into_files(specs, limit, size=lambda spec: spec.nbytes)
        names = file_names(len(groups))
        for file_name, group in zip(names, groups, strict=True):
            with SafetensorsWriter(partial / file_name, group, metadata={"format": "pt"}) as w:
                by_name = {spec.name: spec for spec in group}
                for name in w.names:
                    tensor = handles[located[name]].get_tensor(source[name])
                    if name in merged:
                        tensor = merged[name](tensor.float())
                    w.write(name, tensor.to(getattr(torch, by_name[name].dtype_name)))
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs)},
            "weight_map": {s.name: f for f, g in zip(names, groups, strict=True) for s in g},
        }
        (partial / files.HF_WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    _copy_base_files(base, partial, dtype, untied=bool(copies))
    swap_into_place(partial, output_dir)
    return {
        "output_dir": str(output_dir),
        "base_model": str(base),
        "merged_layers": len(merged),
        "files": names,
        "total_size": sum(s.nbytes for s in specs),
    }


def _copy_base_files(base: Path, dest: Path, dtype: str | None, *, untied: bool) -> None:
    """The base's config (its dtype updated, untied where `untied`), generation config and
    tokenizer files."""
    for path in base.iterdir():
        if (
            path.is_file()
            and not path.name.endswith(".safetensors")
            and path.name != (files.HF_WEIGHTS_INDEX)
        ):
            shutil.copy2(path, dest / path.name)
    if dtype is None and not untied:
        return
    config = json.loads((dest / files.MODEL_CONFIG).read_text())
    if dtype is not None:
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    if untied:
        config["tie_word_embeddings"] = False
    (dest / files.MODEL_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
