"""Grids of runs on Ray Tune, one job per module (the CLI is isoloco_ray/tune.py):

    spec.py       grid files (tune_configs/*.yaml) as pydantic models, field by field
    expand.py     a grid file expanded into trials, each validated with its data: Trial, Search
    plan.py       a grid file loaded, expanded and validated with its data: GridPlan
    console.py    the dry run's plan and the per-round progress lines
    cluster.py    the Ray cluster a grid runs on, and the trials it fits at once
    trainable.py  the Tune function trainable: one TorchTrainer per trial
    scheduler.py  early stopping (scheduler:) on the rounds that report its metric
    search.py     search (search:): one seeded Optuna searcher per grid point
    resume.py     --resume from the grid's own JSON, never Tune's pickled state

Imports go one way: spec imports no other module here, expand imports spec, and the rest
build on those two; plan and trainable import no other module besides them; resume imports
both, scheduler imports trainable, cluster plan, search plan, resume and trainable, and
console plan, scheduler, search and trainable. spec, expand and plan import no Ray.
"""
