"""`python -m isoloco_ray.evaluate RUN_OR_MODEL_DIR [--data DIR] [--split valid|test]
[--tokens N]`: the loss and perplexity of a trained model on a prepared dataset.

RUN_OR_MODEL_DIR is a run directory (`model/`, `config.json`, `summary.json`, as
`python -m isoloco_ray.train` leaves it) or a model directory (a Hugging Face model with
safetensors weights, e.g. a run's `model/`). The evaluation is training's own
(workers/evaluate.py: the first `--tokens` of the split cut into sequences of `seq_len`, the
token-weighted mean next-token NLL, scored in micro-batches), with a run's `data.seq_len`,
`data.micro_batch_size`, `run.eval_tokens` and `run.autocast` by default, so a run's valid
split evaluated with its defaults gives its `final_eval_loss`. For a run directory the result
is also recorded in its `summary.json`, under `evaluations`, keyed by data, split, tokens and
seq_len (`evaluation_key`). The data may be a local directory or a URI (`--data
s3://bucket/prefix`, a run's data.path), read in place.

Weights are read from safetensors only (nothing is unpickled). Every usage problem (a missing
or unrecognised directory, data without the split, a vocabulary the model does not cover, a bad
number) is one `error:` line and exit status 2, before the model is loaded where possible.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upath import UPath

from isoloco_ray import run_files, strict_json
from isoloco_ray.config import (
    ConfigError,
    DataConfig,
    RunConfig,
    TrainConfig,
    format_validation_error,
)
from isoloco_ray.data.format import META_FILE, DataError, DatasetMeta, split_files
from isoloco_ray.storage import local_copy, location

PROG = "python -m isoloco_ray.evaluate"
# A model directory holds a config.json too (its Hugging Face config, not run_files.CONFIG).
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class UsageError(ValueError):
    """A problem with the command line or its directories; the message names it and the fix."""


@dataclass(frozen=True)
class Target:
    """What RUN_OR_MODEL_DIR turned out to be."""

    model_dir: Path  # the Hugging Face model directory
    run_dir: Path | None  # the run directory, when given one
    config: TrainConfig | None  # the run's resolved configuration
    summary: dict[str, Any] | None  # the run's summary.json (None while the run is unfinished)


@dataclass(frozen=True)
class Evaluation:
    """One measurement: its settings and its result."""

    data: Path | UPath
    split: str
    tokens: int  # requested: the first `tokens` of the split (at least one sequence)
    seq_len: int
    batch_size: int
    sequences: int  # sequences scored
    predicted_tokens: int  # next-token predictions averaged: sequences * (seq_len - 1)
    device: str
    autocast: str
    loss: float
    perplexity: float
    seconds: float
    model_sha256: str  # of the weights evaluated (as summary.json's model_sha256)

    def record(self) -> dict[str, Any]:
        """The summary.json entry (strict JSON: a non-finite loss becomes null)."""
        return {"data": str(self.data), "split": self.split, "tokens": self.tokens,
                "seq_len": self.seq_len, "batch_size": self.batch_size,
                "sequences": self.sequences, "predicted_tokens": self.predicted_tokens,
                "device": self.device, "autocast": self.autocast, "loss": self.loss,
                "perplexity": self.perplexity, "seconds": self.seconds,
                "model_sha256": self.model_sha256,
                "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def evaluation_key(data: Path | UPath, split: str, tokens: int, seq_len: int) -> str:
    """The `evaluations` key of a measurement in summary.json: what defines its value."""
    return f"{data}|{split}|tokens={tokens}|seq_len={seq_len}"


def find_target(path: Path) -> Target:
    """Read RUN_OR_MODEL_DIR: a run directory (model/ + config.json) or a model directory
    (config.json + safetensors weights); UsageError saying which it is not and why."""
    where = f"RUN_OR_MODEL_DIR {path}"
    if not path.exists():
        raise UsageError(f"{where} does not exist")
    if not path.is_dir():
        raise UsageError(f"{where} is not a directory; give a run directory (runs/NAME) or a "
                         "model directory (runs/NAME/model)")
    if (path / run_files.MODEL_DIR).is_dir() and (path / run_files.CONFIG).is_file():
        config = _run_config(path)
        summary_path = path / run_files.SUMMARY
        summary = _read_json(summary_path) if summary_path.is_file() else None
        return Target(path / run_files.MODEL_DIR, path, config, summary)
    has_config = (path / run_files.CONFIG).is_file()
    if has_config and any((path / name).is_file() for name in WEIGHTS):
        return Target(path, None, None, None)
    if has_config and _is_run_config(path / run_files.CONFIG):
        raise UsageError(f"{where} is a run without a model yet ({run_files.MODEL_DIR}/ is written "
                         "when the run finishes); finish it first (run the same train command "
                         "again)")
    if any((path / name).is_file() for name in PICKLED_WEIGHTS):
        raise UsageError(f"{where} holds only pickled weights (pytorch_model.bin), which are "
                         "never loaded; save the model with safe_serialization=True")
    raise UsageError(f"{where} is neither a run directory ({run_files.MODEL_DIR}/ and "
                     f"{run_files.CONFIG}) nor a "
                     f"model directory ({run_files.CONFIG} and {WEIGHTS[0]})")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path} does not hold a JSON object")
    return value


def _is_run_config(path: Path) -> bool:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(value, dict) and {"model", "data", "scaling", "run"} <= value.keys()


def _run_config(run_dir: Path) -> TrainConfig:
    from pydantic import ValidationError

    try:
        return TrainConfig.model_validate(_read_json(run_dir / run_files.CONFIG))
    except ValidationError as exc:
        raise UsageError(f"{run_dir / run_files.CONFIG} is not a valid run configuration: "
                         f"{format_validation_error(exc)}") from None


def default_data_dir(target: Target) -> str:
    """The data a run trained on: summary.json's data_dir, else config.json's data.path (a
    local path or a URI)."""
    if target.summary is not None and target.summary.get("data_dir"):
        return str(target.summary["data_dir"])
    if target.config is not None and target.config.data.path is not None:
        return str(target.config.data.path)
    what = ("a model directory names no data" if target.run_dir is None
            else f"{target.run_dir} records no data directory")
    raise UsageError(f"--data: {what}; pass --data DIR (a prepared dataset)")


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} must be a positive number, got {value}")


def check_data(data: Path | UPath, split: str, seq_len: int | None) -> DatasetMeta:
    """The dataset's meta.json, after checking it holds `split` with sequences of `seq_len`
    (None: not chosen yet); UsageError naming the flag otherwise."""
    if not (data / META_FILE).is_file():
        raise UsageError(f"--data: {data} is not a prepared dataset (no {META_FILE}); create one "
                         "with `python -m isoloco_ray.data.prepare`")
    meta = DatasetMeta.load(data)
    if not meta.split(split).shards:
        have = [name for name, info in meta.splits.items() if info.shards]
        raise UsageError(f"--split {split}: {data} holds no {split} data (it has "
                         f"{', '.join(have) or 'none'}); choose another --split or --data")
    if seq_len is not None and seq_len > meta.block_len:
        raise UsageError(f"--seq-len {seq_len} is longer than the blocks of {data} "
                         f"({meta.block_len} tokens); lower --seq-len")
    return meta


def check_vocabulary(model_vocab: int, meta: DatasetMeta, data: Path | UPath) -> None:
    """The model's embedding must cover the data's vocabulary."""
    if meta.vocab_size > model_vocab:
        raise UsageError(f"--data: the vocabulary of {data} ({meta.vocab_size} tokens, "
                         f"{META_FILE}) is larger than the model's ({model_vocab}): the data was "
                         "made with another tokenizer; evaluate on data prepared with the "
                         "model's tokenizer")


def model_config(model_dir: Path) -> Any:
    """The model's Hugging Face config (config.json only: cheap, checked before the weights)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the model config in {model_dir}: {exc}") from None


def load_model(model_dir: Path, config: Any, device: Any) -> Any:
    """The causal LM in `model_dir`, float32, from safetensors only (never unpickled)."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one result line, not a bar per load
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config,
                                                     use_safetensors=True, dtype=torch.float32)
    except SafetensorError as exc:  # a file cut short (a copy or a disk that failed) or garbled
        raise UsageError(f"cannot load the model in {model_dir}: its safetensors weights are "
                         f"damaged or cut short ({str(exc).splitlines()[0]}); export or copy "
                         "the model again") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load the model in {model_dir}: {exc}") from None
    return model.to(device)


def run_evaluation(target: Target, data: Path | UPath, split: str, tokens: int | None,
                   seq_len: int | None, batch_size: int | None, device_name: str,
                   autocast: str | None) -> Evaluation:
    """Load the model and evaluate it on the first `tokens` of `split` (defaults: the run's
    settings, or for a model directory the defaults of a run)."""
    import torch

    from isoloco_ray.workers.evaluate import eval_sequences, evaluate, perplexity
    from isoloco_ray.workers.model import Runtime
    from isoloco_ray.workers.state.checkpoint import parameters_sha256

    cfg = target.config
    tokens = tokens or (cfg.run.eval_tokens if cfg else RunConfig.model_fields["eval_tokens"]
                        .default)
    batch_size = batch_size or (cfg.data.micro_batch_size if cfg else
                                DataConfig.model_fields["batch_size"].default)
    autocast = autocast or (cfg.run.autocast if cfg else "auto")
    seq_len = seq_len or (cfg.data.seq_len if cfg else None)
    meta = check_data(data, split, seq_len)
    if device_name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device_name}: CUDA is not available here; use --device cpu")
    # transformers reads local directories only: a stored model is copied once per version.
    model_dir = (target.model_dir if isinstance(target.model_dir, Path)
                 else local_copy(target.model_dir, kind="models"))
    config = model_config(model_dir)
    check_vocabulary(config.vocab_size, meta, data)
    context = getattr(config, "max_position_embeddings", None)
    if seq_len is None:  # a model directory: the data's blocks, within the model's context
        seq_len = min(meta.block_len, context or meta.block_len)
    if context is not None and seq_len > context:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's context "
                         f"(max_position_embeddings {context}); lower --seq-len")
    sequences = eval_sequences(split_files(data, split), seq_len, tokens)
    largest = int(sequences.max())
    if largest >= config.vocab_size:
        raise UsageError(f"--data: {data} holds token id {largest} in its {split} split, outside "
                         f"the model's vocabulary ({config.vocab_size}); evaluate on data "
                         "prepared with the model's tokenizer")
    device = torch.device(device_name)
    model = load_model(model_dir, config, device)
    runtime = Runtime.create(model, device, autocast, compile=False)
    started = time.perf_counter()
    loss = evaluate(runtime, sequences, rank=0, world=1, batch_size=batch_size)
    return Evaluation(data=data, split=split, tokens=tokens, seq_len=seq_len,
                      batch_size=batch_size, sequences=len(sequences),
                      predicted_tokens=sequences.numel() - len(sequences), device=str(device),
                      autocast=autocast, loss=loss, perplexity=perplexity(loss),
                      seconds=time.perf_counter() - started,
                      model_sha256=parameters_sha256(dict(model.named_parameters())))


def record_evaluation(run_dir: Path, evaluation: Evaluation) -> Path:
    """Add `evaluation` to the run's summary.json (under `evaluations`, replacing an earlier
    measurement of the same key), atomically; returns the file's path."""
    path = run_dir / run_files.SUMMARY
    summary = _read_json(path)
    evaluations = summary.setdefault("evaluations", {})
    key = evaluation_key(evaluation.data, evaluation.split, evaluation.tokens,
                         evaluation.seq_len)
    evaluations[key] = evaluation.record()
    strict_json.write(path, summary, indent=2)
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Loss and perplexity of a trained model on a prepared dataset, measured "
                    "as training measures its validation loss. For a run directory the result "
                    "is also added to its summary.json (evaluations).")
    p.add_argument("target", metavar="RUN_OR_MODEL_DIR",
                   help="a run directory (runs/NAME, or a URI such as s3://bucket/runs/NAME) "
                        "or a Hugging Face model directory with safetensors weights (e.g. "
                        "runs/NAME/model)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="a prepared dataset, a local directory or a URI such as "
                        "s3://bucket/prefix (default: the run's data; needed for a model "
                        "directory)")
    p.add_argument("--split", choices=("valid", "test"), default="valid",
                   help="the split to evaluate (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=None, metavar="N",
                   help="evaluate the split's first N tokens, or all of it when it holds "
                        "fewer (default: the run's run.eval_tokens, else %d)"
                        % RunConfig.model_fields["eval_tokens"].default)
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="tokens per sequence (default: the run's data.seq_len; for a model "
                        "directory the data's block length, within the model's context)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="sequences per forward pass (default: the run's data.micro_batch_size, "
                        "else %d)" % DataConfig.model_fields["batch_size"].default)
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="cpu (default) or cuda (cuda:N)")
    p.add_argument("--autocast", choices=("auto", "bf16", "off"), default=None,
                   help="bf16 autocast (default: the run's run.autocast, else auto: on GPU only)")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status: 0 ok, 2 a usage or data problem (one `error:`
    line), 1 when the result could not be written to summary.json."""
    args = _parser().parse_args(argv)
    try:
        for flag in ("tokens", "seq_len", "batch_size"):
            _positive(f"--{flag.replace('_', '-')}", getattr(args, flag))
        if args.seq_len is not None and args.seq_len < 2:
            raise UsageError(f"--seq-len must be at least 2 (a token and its successor), got "
                             f"{args.seq_len}")
        if args.device != "cpu" and not args.device.startswith("cuda"):
            raise UsageError(f"--device {args.device}: use cpu or cuda (cuda:N)")
        target = find_target(location(args.target, "RUN_OR_MODEL_DIR"))
        data = location(args.data or default_data_dir(target), "--data")
        if args.data is None and not (data / META_FILE).is_file():
            raise UsageError(f"--data: the run's data {data} is no longer a prepared dataset "
                             f"(no {META_FILE}); pass --data DIR")
        check_data(data, args.split, args.seq_len)  # before the model is loaded
        evaluation = run_evaluation(target, data, args.split, args.tokens, args.seq_len,
                                    args.batch_size, args.device, args.autocast)
    except (UsageError, ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{evaluation.split} loss {evaluation.loss:.6f} (ppl {evaluation.perplexity:.2f}): "
          f"{evaluation.sequences:,} sequences of {evaluation.seq_len} tokens "
          f"({evaluation.predicted_tokens:,} predictions) of {evaluation.data}, "
          f"{evaluation.device}, {evaluation.seconds:.1f}s")
    if target.run_dir is None:
        return 0
    recorded = (target.summary or {}).get("model_sha256")
    if recorded and recorded != evaluation.model_sha256:
        print(f"warning: {target.model_dir} is not the model the run finished with (its "
              f"parameters' sha256 differs from {run_files.SUMMARY}'s model_sha256)",
              file=sys.stderr)
    if target.summary is None:
        print(f"not recorded: {target.run_dir} has no {run_files.SUMMARY} (the run has not "
              "finished)")
        return 0
    try:
        path = record_evaluation(target.run_dir, evaluation)
    except (OSError, UsageError) as exc:
        print(f"error: cannot record the evaluation in {target.run_dir / run_files.SUMMARY}: {exc}",
              file=sys.stderr)
        return 1
    print(f"recorded in {path} (evaluations)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
