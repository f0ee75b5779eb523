"""The files of a run directory (`run.storage_path/run.name`), named in one place.

Ray Train adds its own beside them: `checkpoint_<time>/` directories and its record of them,
`checkpoint_manager_snapshot.json` (workers/state/resume.py).
"""

CONFIG = "config.json"  # the resolved TrainConfig; a resume must match it
METRICS = "metrics.jsonl"  # one line per round, from the driver
SUMMARY = "summary.json"  # written last: its presence means the run finished
MODEL_DIR = "model"  # the exported Hugging Face model (workers/state/export.py)
ERROR = "error.txt"  # a failed grid trial: the traceback
STOPPED = "stopped.json"  # a grid trial a scheduler stopped early
FT_END = "ft_end.json"  # fault_tolerance replica: the run's result (workers/quorum/replica_mode.py)
FT_CHECKPOINT = "ftcheckpoint_{round:06d}"  # ... and its checkpoints, one per checkpoint round
GRID = "grid.json"  # a grid directory (isoloco_ray.tune): name, metric, mode, trials
RUNS = "runs"  # ... and its trials' run directories, runs/<trial>/
LOCK = ".run.lock"  # held while a run of the directory is live (storage.hold_run)
