"""The run's exported model: a Hugging Face directory (`<run>/model`) written, checked and only
then put in place, so that a run is never called finished without its model.

The model and tokenizer are saved into a staging directory first; the files `from_pretrained`
needs must be there and the tensors read back from disk must hash to the trained parameters
(`checkpoint.parameters_sha256`). Only then do they replace `<run>/model`, which may hold an
earlier export of the same run (a rerun after a crash during the export), never a file or files
the run did not write: those are refused with `ExportError`, nothing touched.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel

from isoloco_ray import storage
from isoloco_ray.data.format import load_tokenizer
from isoloco_ray.workers.state.checkpoint import parameters_sha256

# Beside the model of a run that diverged (its summary says why too).
DIVERGED_FILE = "DIVERGED.txt"
# What an export writes (HF model and tokenizer); an existing model directory holding anything
# else is not this run's and is never written into.
EXPORT_NAMES = ("config.json", "generation_config.json", "model.safetensors",
                "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", DIVERGED_FILE)
REQUIRED_NAMES = ("config.json", "tokenizer.json")


class ExportError(RuntimeError):
    """The model could not be exported completely, or `<run>/model` is not the run's to
    replace; the message names the path and the fix."""


def export_into_summary(summary: dict[str, Any], model: PreTrainedModel, data_dir: Any,
                        out_dir: Any) -> None:
    """The run's last step, on the worker that writes its files: export `model` to `out_dir`
    (`export_model`, marked if `summary` says the run diverged), or put why it could not be
    in `summary["error"]`: a run without its model is not finished, and the error keeps it
    resumable."""
    try:
        export_model(model, data_dir, out_dir, summary.get("diverged"))
    except ExportError as exc:
        summary["error"] = str(exc)


def export_model(model: PreTrainedModel, data_dir: Any, out_dir: Any,
                 diverged: str | None = None) -> None:
    """Save `model` (safetensors) and the data's tokenizer for `from_pretrained` in `out_dir`
    (local, or on object storage), checked before it replaces what is there. A run that
    diverged (`diverged`: why) still exports its model, marked by DIVERGED_FILE."""
    refuse_foreign(out_dir)
    local_out = isinstance(out_dir, Path)
    # Beside the destination when local, so that putting it in place is a rename.
    staging = Path(tempfile.mkdtemp(prefix=".model-export-", dir=out_dir.parent if local_out
                                    else None))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        load_tokenizer(data_dir).save_pretrained(staging)
        if diverged is not None:
            (staging / DIVERGED_FILE).write_text(f"This run diverged: {diverged}.\n")
        check_export(staging, model)
        if local_out:
            if out_dir.exists():
                shutil.rmtree(out_dir)  # an earlier export of this run (refuse_foreign)
            staging.rename(out_dir)
        else:
            if out_dir.exists():
                for old in out_dir.iterdir():
                    old.unlink()
            storage.upload_directory(staging, out_dir)
            written = {p.name: p.stat().st_size for p in out_dir.iterdir()}
            expected = {p.name: p.stat().st_size for p in staging.iterdir()}
            if written != expected:
                raise ExportError(f"{out_dir}: the uploaded model does not match what was "
                                  f"written (files and sizes {written} against {expected}); "
                                  "run the same command again to export it again")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def refuse_foreign(out_dir: Any) -> None:
    """ExportError when `out_dir` is a file, or a directory holding files an export does not
    write, or a symbolic link (never followed: an earlier export is replaced by removing it,
    which would empty the link's target)."""
    if isinstance(out_dir, Path) and out_dir.is_symlink():
        raise ExportError(f"{out_dir} is a symbolic link, not the model directory this run "
                          "writes; remove the link, then run the same command again to export "
                          "the model (the run's checkpoints are kept)")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"{out_dir} is a file, not the model directory this run writes; "
                          "move it away, then run the same command again to export the model "
                          "(the run's checkpoints are kept)")
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in EXPORT_NAMES)
    if foreign:
        raise ExportError(f"{out_dir} holds files this run did not write ({', '.join(foreign)});"
                          " move them away, then run the same command again to export the "
                          "model (the run's checkpoints are kept)")


def check_export(directory: Path, model: nn.Module) -> None:
    """ExportError unless `directory` holds the config, tokenizer and weights, and the weights
    on disk are the model's parameters (a tied head may be stored once)."""
    missing = [name for name in REQUIRED_NAMES if not (directory / name).is_file()]
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        missing.append("model.safetensors")
    if missing:
        raise ExportError(f"the exported model lacks {', '.join(missing)} (written to "
                          f"{directory}); check the disk, then run the same command again")
    on_disk = {}
    for path in weights:
        on_disk.update(load_file(path))
    trained = dict(model.state_dict())
    stored_once = {name for name in trained if name not in on_disk}
    tied = {name for name in stored_once
            if any(trained[name].data_ptr() == trained[other].data_ptr() for other in on_disk
                   if other in trained)}
    if set(on_disk) - set(trained) or stored_once - tied or parameters_sha256(on_disk) != \
            parameters_sha256({name: trained[name] for name in on_disk}):
        raise ExportError(f"the exported model in {directory} is not the trained one (its "
                          "tensors read back differ); check the disk, then run the same "
                          "command again")
