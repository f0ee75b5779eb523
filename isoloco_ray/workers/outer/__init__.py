"""The outer step, in the order a round runs it (docs/design.md, "The outer sync"):

    (the route payloads travel, chosen once from strategy, placement and wire, is the
    registry's: strategies.Route)
    payload.py    what each rank sends: its good replicas' Δ_r sum, or each Δ_r (pruned,
                  with error feedback)
    transport.py  moving payloads and updates between ranks, in the wire format (codec.py)
    plan.py       which rank owns (merges) each tensor when owners merge
    step.py       OuterSync: good replicas, payload → route → merge → momentum → θ
"""
