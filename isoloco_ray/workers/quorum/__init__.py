"""`scaling.fault_tolerance: replica`: training over the workers alive each round (torchft),
beside the plain path, which has no fault-tolerance branch:

    replica_mode.py        a worker's run over quorums: the lighthouse, reports, checkpoints
    seat.py                QuorumSeat: a worker's place in torchft's quorums, one per sync
    seated_trainer.py      SeatedTrainer: the Trainer over a seat (join, writer, healing)
    rounds.py              QuorumRounds: the plain round, synced through the seat
    sync.py                QuorumSync: the outer step over the round's contributors
    straggler_deadline.py  how long the others wait for a slow worker
"""
