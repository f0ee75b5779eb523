"""Parallel plumbing (torch.distributed):

    layout.py            which replicas a worker hosts, its process groups
    collectives.py       the collective calls on flat buffers, with byte counting
    gradient_average.py  a replica spread over G workers: gradients averaged while backward runs
"""
