"""The exported model (workers/state/export.py): checked on disk before it is put in place, and
never written over a file or a directory the run did not write."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from isoloco_ray.config import load_config
from isoloco_ray.data.format import DatasetMeta
from isoloco_ray.workers.model import build_model
from isoloco_ray.workers.state import export
from isoloco_ray.workers.state.checkpoint import parameters_sha256
from isoloco_ray.workers.state.export import ExportError, export_model


@pytest.fixture
def model(small_dataset):
    cfg = load_config(["--model.preset=tiny"])
    return build_model(cfg.model, DatasetMeta.load(small_dataset).vocab_size, seed=3)


def test_the_export_is_the_trained_model_and_nothing_is_left_beside_it(model, small_dataset,
                                                                       tmp_path):
    export_model(model, small_dataset, tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert parameters_sha256(dict(loaded.named_parameters())) == \
        parameters_sha256(dict(model.named_parameters()))


def test_a_file_or_foreign_files_in_the_way_are_refused_and_kept(model, small_dataset,
                                                                 tmp_path):
    in_the_way = tmp_path / "model"
    in_the_way.write_text("my notes")
    with pytest.raises(ExportError, match=rf"^{in_the_way} is a file, not the model directory "
                                          "this run writes; move it away, then run the same "
                                          "command again"):
        export_model(model, small_dataset, in_the_way)
    assert in_the_way.read_text() == "my notes"
    in_the_way.unlink()
    in_the_way.mkdir()
    (in_the_way / "results.csv").write_text("mine")
    with pytest.raises(ExportError, match=r"holds files this run did not write \(results.csv\)"):
        export_model(model, small_dataset, in_the_way)
    assert [p.name for p in in_the_way.iterdir()] == ["results.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left
    # A link planted where the model goes, to an earlier export elsewhere: never followed.
    elsewhere = tmp_path / "elsewhere"
    export_model(model, small_dataset, elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    linked = tmp_path / "linked"
    linked.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ExportError, match=rf"^{linked} is a symbolic link, not the model "):
        export_model(model, small_dataset, linked)
    assert linked.is_symlink() and sorted(p.name for p in elsewhere.iterdir()) == before


def test_an_export_that_reads_back_wrong_is_refused_and_the_old_one_kept(model, small_dataset,
                                                                         tmp_path,
                                                                         monkeypatch):
    out = tmp_path / "model"
    export_model(model, small_dataset, out)
    before = load_file(out / "model.safetensors")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # trained further: the next export replaces it

    def flipped(path):
        tensors = load_file(path)
        name = next(iter(tensors))
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += 1e-3  # one value that did not reach the disk intact
        return tensors

    monkeypatch.setattr(export, "load_file", flipped)
    with pytest.raises(ExportError, match="is not the trained one"):
        export_model(model, small_dataset, out)
    after = load_file(out / "model.safetensors")
    assert all(torch.equal(after[name], before[name]) for name in before)  # the old one kept
    monkeypatch.undo()
    export_model(model, small_dataset, out)  # an earlier export of the run is replaced
    assert parameters_sha256(load_file(out / "model.safetensors")) != parameters_sha256(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_diverged_runs_model_is_exported_marked(model, small_dataset, tmp_path):
    export_model(model, small_dataset, tmp_path / "model", diverged="its last rounds were skipped")
    assert (tmp_path / "model" / "DIVERGED.txt").read_text() == \
        "This run diverged: its last rounds were skipped.\n"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "model") is not None


def test_the_runs_last_step_exports_or_says_why_in_its_summary(model, small_dataset, tmp_path):
    """export_into_summary (both Ray entry points' last step): the model, marked when the run
    diverged, or the export's error in the summary, which keeps the run unfinished."""
    summary = {"status": "diverged", "diverged": "every replica diverged"}
    export.export_into_summary(summary, model, small_dataset, tmp_path / "model")
    assert "error" not in summary
    assert (tmp_path / "model" / export.DIVERGED_FILE).exists()
    in_the_way = tmp_path / "other"
    in_the_way.write_text("my notes")
    summary = {"status": "done"}
    export.export_into_summary(summary, model, small_dataset, in_the_way)
    assert summary["error"].startswith(f"{in_the_way} is a file, not the model directory")
    assert in_the_way.read_text() == "my notes"
