"""Host time of one draft-length decision at batch 64, S = 3 (issue 34): GoodputPolicy against
PerRequestGoodputPolicy (a search every call, a choice on the kept price, and its default mix of
one search in ``search_every``), while requests wait (tokens per second) and when none waits
(drain objective). Each policy first runs 200 steps of bench/simulate_per_request.py's scripted
queue (estimates, costs), then decides for a different batch of 64 each call; wall time of
``choose`` (median and mean over 360 calls after 40).

    PYTHONPATH=$PWD python bench/time_policy_decisions.py
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simulate_per_request import simulate  # noqa: E402

import mtp_ctrl  # noqa: E402

from mtp_ctrl.controllers import GoodputPolicy, PerRequestGoodputPolicy  # noqa: E402
from mtp_ctrl.controllers.draft_policy import DraftLengthQuery  # noqa: E402

G, S = 64, 3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    mtp_ctrl.quiet_known_warnings(parser.parse_args().verbose)
    policies = [("goodput", GoodputPolicy),
                ("per-request, a search each", lambda: PerRequestGoodputPolicy(search_every=1)),
                ("per-request, the kept price", lambda: PerRequestGoodputPolicy(search_every=10 ** 9)),
                ("per-request (default)", PerRequestGoodputPolicy)]
    for name, make in policies:
        for drain in (False, True):
            policy = make()
            simulate(policy, G, S, steps=200)
            first = np.arange(10000, 10000 + G)
            times = []
            for call in range(400):
                ids = first + call % 50  # a different batch each call (a queue's)
                if call % 50 == 0:
                    policy.observe(ids, np.full(G, 2), np.ones(G, dtype=np.int64))
                query = DraftLengthQuery(ids, np.full(G, S), S, G, 2, 0 if drain else 100, np.full(G, 30))
                started = time.perf_counter()
                policy.choose(query)
                times.append(time.perf_counter() - started)
            times = np.array(times[40:]) * 1e3
            print(f"{name:>28}, {'drain' if drain else 'tokens/s'}: median {np.median(times):.3f} ms, "
                  f"mean {times.mean():.3f} ms", flush=True)


if __name__ == "__main__":
    main()
