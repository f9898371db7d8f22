"""A rank that fails alone while the others wait for it in a collective, started by
``spawn_local``: ``python tests/support/peer_failure_worker.py FAILING_RANK``.

Every rank starts the process group as the trainer does (``init_distributed``, which
starts the peer watch); the failing rank raises in work of its own, announces it and
exits 3 as a command does; the others wait for it in a broadcast it never joins, which
only the peer watch can end (exit 4, one line naming the failure).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from parallel.collectives import broadcast_object, rank  # noqa: E402
from parallel.distributed import destroy_distributed, init_distributed  # noqa: E402
from parallel.layout import ParallelLayout  # noqa: E402
from parallel.peer_failure import announce_failure  # noqa: E402


def main(failing: int) -> int:
    init_distributed(ParallelLayout(), timeout_minutes=10)
    try:
        if rank() == failing:
            raise RuntimeError(f"the rollout server of rank {failing} went away")
        broadcast_object(None, src=failing)  # the failing rank never joins it
        return 0
    except BaseException as e:
        announce_failure(e)
        return 3
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
