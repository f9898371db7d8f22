"""Training entry point for launchers:

deepspeed --num_gpus N --module moe_rl.train --config C [key=value ...]
torchrun --nproc_per_node N -m moe_rl.train --config C [key=value ...]
python -m moe_rl.train --config C            (one process; same as `moe-rl train`)
"""

from __future__ import annotations

import sys

from moe_rl.cli import main

if __name__ == "__main__":
    sys.exit(
        main(
            [
                "train",
                *[a for a in sys.argv[1:] if not a.startswith("--local_rank") and not a.startswith("--local-rank")],
            ]
        )
    )
