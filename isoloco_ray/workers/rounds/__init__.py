"""A round, as the Trainer (workers/loop.py) runs it:

    diloco.py         DiLoCoRounds: H inner steps per replica, the stop check, the outer step
                      of every tensor, landed (the plain round on one screen)
    streaming.py      StreamingRounds: the same steps in fragments (outer.fragments, delay,
                      mix), syncs in the background
    data_parallel.py  DataParallelRounds: adamw_ddp's H data-parallel steps
    fragments.py      which tensors sync together, and the order of a round's events
    overlap.py        the background thread a delayed sync runs on
    round_parts.py    what a runner is given (the Trainer's parts it needs, no more)
    round_metrics.py  a round's metrics line
"""
