"""Grids of runs on Ray Tune, one job per module (the CLI is isoloco_ray/tune.py; grid files
are read and expanded by isoloco_ray/grid.py):

    plan.py       a grid file loaded, expanded and validated with its data: GridPlan
    console.py    the dry run's plan and the per-round progress lines
    cluster.py    the Ray cluster a grid runs on, and the trials it fits at once
    trainable.py  the Tune function trainable: one TorchTrainer per trial
    scheduler.py  early stopping (scheduler:) on the rounds that report its metric
    search.py     search (search:): one seeded Optuna searcher per grid point
    resume.py     --resume from the grid's own JSON, never Tune's pickled state

Imports go one way: plan and trainable import no other module here; resume imports both,
scheduler imports trainable, cluster plan, search plan, resume and trainable, and console
plan, scheduler, search and trainable.
"""
